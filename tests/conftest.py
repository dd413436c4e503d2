"""Test setup: 8 fake CPU devices, configured before any JAX backend starts."""

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# stage ILPs in this process: the suite's workers already use every core, and a search
# that spawned its own ILP workers would fight them (tests that want the pool set it)
os.environ.setdefault("AUTOSHARD_JOBS", "1")
# LLVM's code for the tiny test steps at -O0: XLA:CPU compiles them about 35% faster and
# most of a test's time is compiling. The HLO XLA compiles (its collectives, fusions and
# buffer assignment, which the tests compare with the plan) is the same at every level;
# only the machine code differs. Set the flag yourself in XLA_FLAGS to test another level.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
    ).strip()

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)


def load_benchmark(name: str):
    """Import ``benchmarks/<name>.py`` (a script, not a package) as a module; ``name`` may
    name a sub-folder (``"studies/host_overhead_v100"``)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_experiment(stem: str):
    """Import ``experiments/<stem>.py`` as a module (``figure.py`` beside it importable)."""
    import importlib.util
    import sys
    from pathlib import Path

    folder = Path(__file__).resolve().parents[1] / "experiments"
    sys.path.insert(0, str(folder))
    try:
        spec = importlib.util.spec_from_file_location(f"exp_{stem}", folder / f"{stem}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(folder))
    return module


# ----------------------------------------------------------------------------- workers
# pyproject's addopts runs the tests on pytest-xdist workers (-n logical --dist worksteal:
# each worker takes a contiguous half of the files, so module fixtures are built once,
# and steals from the other's tail when it runs dry). Without pytest-xdist (or with
# -p no:xdist) those options are accepted here and the tests run in this one process.


def pytest_addoption(parser, pluginmanager):
    if pluginmanager.has_plugin("xdist"):
        return
    group = parser.getgroup("xdist-absent", "pytest-xdist is absent: these options do nothing")
    # _addoption: pytest reserves lowercase short options for plugins (xdist uses it too)
    group._addoption("-n", "--numprocesses", dest="numprocesses", default=None)
    group.addoption("--maxprocesses", dest="maxprocesses", default=None)
    group.addoption("--dist", dest="dist", default="no")


def pytest_report_header(config):
    if not config.pluginmanager.has_plugin("xdist"):
        return (
            "pytest-xdist is absent: the tests run in one process "
            "(pip install -e '.[dev]' installs it; it runs them on every core)"
        )
    return None


# ----------------------------------------------------------------------------- heavy
# ``heavy`` tests are end-to-end checks taken out of the default run (the README's command
# stays under 10 minutes on 2 cores); each is also ``slow``, so ``-m slow`` runs them, and
# .ci/run runs ``-m heavy`` after the default suite, so CI keeps every assertion.


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("heavy") is not None:
            item.add_marker(pytest.mark.slow)


# ----------------------------------------------------------------------------- shared plans
_PLANS: dict = {}


def shared_plan(traced, mesh, options=None, **kw):
    """``auto_shard_graph(traced.graph, mesh, options, **kw)``, solved once per worker for
    the same traced object (a module or session fixture), mesh, options and keywords:
    several tests check one plan (its collectives against XLA, its training against one
    device, its JSON) without solving it again. Plans are frozen dataclasses. A test
    that asserts what solving warns must call ``auto_shard_graph`` itself."""
    from autoshard.intra.problem.build import auto_shard_graph

    key = (id(traced), repr(mesh), repr(options), repr(sorted(kw.items())))
    hit = _PLANS.get(key)
    if hit is None or hit[0] is not traced:  # the id of a freed object can come back
        hit = _PLANS[key] = (traced, auto_shard_graph(traced.graph, mesh, options, **kw))
    return hit[1]


def save_plan(tmp, model, mesh, baseline=None, **sizes):
    """Plan preset ``model`` on ``mesh`` (HiGHS; ``baseline`` or the ILP's own) and save
    the plan file under ``tmp``; returns its path."""
    from autoshard.api import plan_workload
    from autoshard.intra.problem.options import IntraOptions

    bound = plan_workload(
        model, mesh, baseline=baseline, options=IntraOptions(solver="highs"), **sizes
    )
    path = tmp / f"{model}-{mesh}-{baseline or 'auto'}.json"
    bound.save(path)
    return path


# the CLI in a fresh process whose planner refuses to run (a command that must not plan)
_NO_PLANNER = (
    "import sys\n"
    "import autoshard.intra.problem.build as problem\n"
    "def refuse(*a, **k):\n"
    "    raise AssertionError('the planner ran')\n"
    "problem.auto_shard_graph = refuse\n"
    "from autoshard.cli.main import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)


def run_cli_without_planner(*args):
    """``autoshard *args`` in a fresh process whose planner raises if it runs."""
    import subprocess

    return subprocess.run(
        [sys.executable, "-c", _NO_PLANNER, *args], capture_output=True, text=True, timeout=600
    )


def cli_in_process(capsys, *args):
    """``autoshard *args`` run by ``main()`` in the test's own process: its exit status,
    stdout and stderr. For a command refused before it plans or compiles, a fresh process
    (``python -m autoshard``) would only pay the JAX import again; a traceback here is an
    exception that fails the test. Its fake devices are this process's 8: a command for
    fewer (``--mesh 2``) runs on the first of them (a fresh process would make that many;
    this one cannot change its count once JAX has started), so use it for refusals."""
    from unittest import mock

    import autoshard.cli.main as cli_main

    def setup_devices(n):
        if n and n > len(jax.devices()):
            raise SystemExit(f"cli_in_process: {n} devices asked for, this process has 8")

    try:
        with mock.patch.object(cli_main, "_setup_devices", setup_devices):
            rc = cli_main.main([str(a) for a in args])
    except SystemExit as err:  # argparse's errors
        rc = err.code
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def cli_without_planner_in_process(capsys, monkeypatch, *args):
    """:func:`cli_in_process` with a planner that raises if it runs (the in-process twin
    of :func:`run_cli_without_planner`, for refusals on at most 8 devices)."""
    import autoshard.intra.offload.search as offload_search
    import autoshard.intra.problem.build as problem

    def refuse(*a, **k):
        raise AssertionError("the planner ran")

    monkeypatch.setattr(problem, "auto_shard_graph", refuse)
    monkeypatch.setattr(offload_search, "auto_shard_graph", refuse)
    return cli_in_process(capsys, *args)


@pytest.fixture(autouse=True)
def _restore_unraisablehook():
    """``autoshard.cli.main.main()`` wraps ``sys.unraisablehook`` so that a dropped Ctrl-C
    ends the command (autoshard/cli/interrupt.py); a test that calls main() in this process
    must not leave that on the test process (it printed "autoshard: interrupted" and exited
    130 when the pytest worker later dropped a KeyboardInterrupt)."""
    hook = sys.unraisablehook
    yield
    sys.unraisablehook = hook
