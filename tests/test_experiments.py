"""experiments/ and `autoshard reproduce`: discovery, bad input, and figures that match their JSON.

The figure tests draw each committed figure (docs/figures/<name>.json) again from its
JSON, read back what was drawn (bar heights, out-of-memory crosses, scatter points) and
compare it with the numbers in the JSON, so a figure cannot drift from its data.  No
experiment is run here (they take minutes); `autoshard reproduce --quick` runs them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import load_experiment

from autoshard.cli.main import main
from autoshard.cli.reproduce import default_experiments_dir, discover

ROOT = Path(__file__).resolve().parent.parent
EXPERIMENTS = ROOT / "experiments"
FIGURES = ROOT / "docs" / "figures"
EXPECTED = {
    "weak-scaling", "intra-ablation", "inter-ablation", "planning-time", "truth",
    "planner-scaling", "sim-validation", "frontier", "offload",
}  # fmt: skip


def _script(name: str):
    """The experiment module called ``name`` (imported by path; figure.py beside it)."""
    exp = {e.name: e for e in discover(EXPERIMENTS)}[name]
    return load_experiment(exp.script.stem)


def _drawn(module, doc):
    fig = module.plot(doc)
    import figure  # noqa: E402  (on sys.modules once a script imported it)

    out = figure.drawn(fig)
    figure.plt.close(fig)
    return fig, out


def test_discovery_finds_every_figure_in_order():
    found = discover(default_experiments_dir())
    assert {e.name for e in found} == EXPECTED
    assert all(e.source in ("simulated", "compiled", "measured") for e in found)
    assert [e.name for e in found][0] == "weak-scaling"


def test_reproduce_list_json(capsys):
    assert main(["reproduce", "--list", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert {e["name"] for e in listed} == EXPECTED


def test_reproduce_unknown_name_is_exit_2_with_the_names(capsys):
    assert main(["reproduce", "--only", "no-such-figure", "--list"]) == 2
    err = capsys.readouterr().err
    assert "no-such-figure" in err and "weak-scaling" in err


def test_reproduce_without_experiments_folder_says_where_to_run(tmp_path, capsys):
    assert main(["reproduce", "--list", "--experiments", str(tmp_path / "absent")]) == 2
    assert "clone of the repository" in capsys.readouterr().err


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_committed_figure_has_json_png_and_provenance(name):
    doc = json.loads((FIGURES / f"{name}.json").read_text())
    assert (FIGURES / f"{name}.png").stat().st_size > 10_000
    assert doc["name"] == name and doc["source"] in ("simulated", "compiled", "measured")
    assert doc["git_commit"] and doc["date"] and doc["machine"]["cpus"] >= 1


def _bars_match(drawn: dict, rows, panel: str, height_key: str, series_key: str, group_key):
    for r in rows:
        cell = f"{r[series_key]}|{r[group_key]}"
        if r.get("no_plan"):
            assert f"{panel}::bar|{cell}" not in drawn, cell
            assert f"{panel}::oom|{cell}" not in drawn, cell
        elif r["oom"]:
            assert f"{panel}::oom|{cell}" in drawn, cell
            assert f"{panel}::bar|{cell}" not in drawn, cell
        else:
            x, h = drawn[f"{panel}::bar|{cell}"]
            assert h == pytest.approx(r[height_key], rel=1e-12), cell
            assert f"{panel}::oom|{cell}" not in drawn, cell


def _no_plan_marked(fig, drawn: dict, rows, panel: str) -> None:
    """An open circle exactly where a panel's method has no plan: a ``no_plan`` row, or no
    row at a GPU count where the panel has rows (the method has rows at others)."""
    planned = {(r["method"], r["gpus"]) for r in rows if not r.get("no_plan")}
    every = {(r["method"], g) for r in rows for g in {q["gpus"] for q in rows}}
    for method, g in every:
        assert (f"{panel}::noplan|{method}|{g}" in drawn) == ((method, g) not in planned), (
            method,
            g,
        )
    ax = next(a for a in fig.axes if a.get_title() == panel)
    texts = [t.get_text() for t in ax.get_legend().get_texts()]
    assert ("No plan found" in texts) == (planned != every), texts
    assert ("Out of memory" in texts) == any(r["oom"] for r in rows), texts


def test_weak_scaling_bars_and_crosses_are_the_json():
    module = _script("weak-scaling")
    doc = json.loads((FIGURES / "weak-scaling.json").read_text())
    fig, drawn = _drawn(module, doc)
    for cluster, family in module.panels(doc):
        rows = [r for r in doc["data"]["rows"] if (r["cluster"], r["family"]) == (cluster, family)]
        title = module.panel_title(doc, cluster, family)
        _bars_match(drawn, rows, title, "pflops", "method", "gpus")
        _no_plan_marked(fig, drawn, rows, title)
        # the linear-scaling outline: the best 1-GPU value times the GPU count
        base = max(r["pflops"] for r in rows if r["gpus"] == rows[0]["gpus"] and not r["oom"])
        for g in {r["gpus"] for r in rows}:
            _, h = drawn[f"{title}::bar|linear|{g}"]
            assert h == pytest.approx(base * g / rows[0]["gpus"])


def _panel_drawn(module, family: str, *cells: dict):
    """One made-up weak-scaling panel ("<FAMILY> on c, AdamW": no optimizer recorded) of
    ``cells`` (GPUs, method, PFLOPS, OOM, ...): its rows, and what the script's plot draws
    from them."""
    row = dict(cluster="c", family=family, model=f"{family}-x", plan={}, step_time_s=1.0)
    rows = [row | cell for cell in cells]
    return rows, _drawn(module, {"title": "t", "source": "simulated", "data": {"rows": rows}})


def test_weak_scaling_draws_a_cross_not_a_bar_where_out_of_memory():
    module = _script("weak-scaling")
    rows, (_, drawn) = _panel_drawn(
        module, "gpt",
        dict(gpus=1, method="auto", pflops=1.0, oom=False),
        dict(gpus=1, method="megatron", pflops=0.5, oom=True),
        dict(gpus=2, method="auto", pflops=1.8, oom=False),
        dict(gpus=2, method="megatron", pflops=2.5, oom=True),
    )  # fmt: skip
    _bars_match(drawn, rows, "GPT on c, AdamW", "pflops", "method", "gpus")
    # the OOM bar's 2.5 is not drawn, and the linear outline comes from fitting bars only
    assert drawn["GPT on c, AdamW::bar|linear|2"][1] == pytest.approx(2.0)


def test_weak_scaling_marks_no_plan_apart_from_out_of_memory():
    """A ``no_plan`` row and a missing row (chunks from before no-plan rows) both draw an
    open circle and a legend entry; neither draws a bar or a cross."""
    module = _script("weak-scaling")
    rows, (fig, drawn) = _panel_drawn(
        module, "moe",
        dict(gpus=1, method="auto", pflops=1.0, oom=False),
        dict(gpus=1, method="expert-zero2", pflops=0.9, oom=False),
        dict(gpus=2, method="auto", pflops=1.8, oom=False),
        dict(gpus=2, method="expert-zero2", pflops=None, oom=False, no_plan=True),
        dict(gpus=4, method="auto", pflops=3.0, oom=True),  # expert-zero2: no row
    )  # fmt: skip
    _bars_match(drawn, rows, "MOE on c, AdamW", "pflops", "method", "gpus")
    _no_plan_marked(fig, drawn, rows, "MOE on c, AdamW")
    assert {k for k in drawn if "::noplan|" in k} == {
        "MOE on c, AdamW::noplan|expert-zero2|2",
        "MOE on c, AdamW::noplan|expert-zero2|4",
    }
    assert "MOE on c, AdamW::oom|auto|4" in drawn
    assert drawn["MOE on c, AdamW::noplan|expert-zero2|2"][1] < 0.1 * 1.8  # at the bar's base


def test_weak_scaling_suptitle_clears_the_panel_titles():
    """The figure title sits above every panel's title (6 or 9 panels overlapped it)."""
    module = _script("weak-scaling")
    doc = json.loads((FIGURES / "weak-scaling.json").read_text())
    fig = module.plot(doc)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    top = fig._suptitle.get_window_extent(renderer)
    for ax in fig.axes:
        if ax.get_title():
            assert ax.title.get_window_extent(renderer).y1 < top.y0, ax.get_title()
    import figure

    figure.plt.close(fig)


@pytest.mark.parametrize("name", ["inter-ablation", "intra-ablation"])
def test_ablation_bars_are_the_json(name):
    module = _script(name)
    doc = json.loads((FIGURES / f"{name}.json").read_text())
    _, drawn = _drawn(module, doc)
    panel = module.panel_title(doc)
    _bars_match(drawn, doc["data"]["rows"], panel, "pflops", "method", "gpus")


def test_planning_time_stacks_are_the_json():
    module = _script("planning-time")
    doc = json.loads((FIGURES / "planning-time.json").read_text())
    fig, drawn = _drawn(module, doc)
    title = fig.axes[0].get_title()
    for r in doc["data"]["rows"]:
        for phase, seconds in r["phase_seconds"].items():
            _, h = drawn[f"{title}::bar|{phase}|{r['gpus']}"]
            assert h == pytest.approx(seconds)
    for g, ref in doc["data"]["reported"].items():
        if any(str(r["gpus"]) == g for r in doc["data"]["rows"]):
            assert drawn[f"{title}::bar|reported|{g}"][1] == ref["seconds"]


def _frontier_row(name, cluster, gpus, walls, phases, search, tp_pp_dp, mfu, **extra):
    stages = extra.pop("stages", [])
    return {
        "row": name, "model": "gpt-175b", "cluster": cluster, "gpus": gpus,
        "global_batch": 1536, "wall_seconds": walls,
        "median_wall_seconds": sorted(walls)[len(walls) // 2], "summary_run": 1,
        "auto": {
            "phase_seconds": phases, "search_seconds": search, "tp_pp_dp": tp_pp_dp,
            "mfu": mfu, "oom": False, "num_microbatches": 96, "stages": stages,
        },
        **extra,
    }  # fmt: skip


FRONTIER_FAKE = {
    "name": "frontier", "title": "t", "source": "measured", "quick": True,
    "data": {
        "measured": {"loadavg_before": [3.0, 3.0, 3.0]},
        "reported": [{"planner": "Alpa", "model": "gpt-39b", "gpus": 64, "seconds": 2400.0}],
        "rows": [
            _frontier_row(
                "a", "dgx-a100", 1024, [30.0, 20.0, 40.0],
                {"trace": 2.0, "intra_op_ilps": 10.0, "stage_dp": 1.0}, 13.5, [8, 16, 8], 0.3,
                published={"tp_pp_dp": [8, 12, 16], "priced": {"microbatch_1": {
                    "mfu": 0.2, "oom": True, "peak_gib_per_device": 108.0}}},
            ),
            _frontier_row(
                "h", "dgx-h100", 1024, [9.0, 8.0, 7.0],
                {"trace": 1.0, "intra_op_ilps": 4.0, "stage_dp": 0.5}, 5.5, [None, 32, None],
                0.25, stages=[[[4, 8], [4, 8], "full"], [[4, 8], [8, 4], "none"]],
            ),
            {"row": "x", "model": "gpt-1t", "cluster": "dgx-a100", "gpus": 4096,
             "global_batch": 4096, "wall_seconds": [5.0], "median_wall_seconds": 5.0,
             "error": "boom"},
        ],
    },
}  # fmt: skip


@pytest.mark.parametrize("source", ["committed", "fake"])
def test_frontier_phases_medians_and_mfu_are_the_json(source):
    """Each row's bar is its phases stacked (the rest: that run's wall minus its search),
    the marker its median wall, the stars the published times, the right panel its MFU."""
    module = _script("frontier")
    if source == "committed":
        doc = json.loads((FIGURES / "frontier.json").read_text())
    else:
        doc = FRONTIER_FAKE
    fig = module.plot(doc)
    left, right = fig.axes
    bars = {p.get_gid(): p for p in left.patches if p.get_gid()}
    lines = {ln.get_gid(): ln for ln in left.lines if ln.get_gid()}
    rows = doc["data"]["rows"]
    for r in rows:
        if "auto" not in r:
            assert f"noplan|{r['row']}" in lines
            assert not any(g.endswith(f"|{r['row']}") for g in bars)
            continue
        top, x = 0.0, None
        run_wall = r["wall_seconds"][r.get("summary_run", len(r["wall_seconds"]) - 1)]
        for key in ("trace", "intra_op_ilps", "stage_dp", "rest"):
            bar = bars[f"bar|{key}|{r['row']}"]
            want = run_wall - r["auto"]["search_seconds"] if key == "rest" else (
                r["auto"]["phase_seconds"][key])  # fmt: skip
            assert bar.get_height() == pytest.approx(want)
            assert bar.get_y() == pytest.approx(top)  # stacked on the phases before
            top += want
            x = x or bar.get_x()
            assert bar.get_x() == x  # one bar per row
        assert lines[f"median|{r['row']}"].get_ydata()[0] == r["median_wall_seconds"]
    xs = {bars[f"bar|trace|{r['row']}"].get_x() for r in rows if "auto" in r}
    assert len(xs) == len([r for r in rows if "auto" in r])  # rows at one count side by side
    for ref in doc["data"]["reported"]:
        star = lines[f"reported|{ref['planner']}|{ref['gpus']}"]
        assert (star.get_xdata()[0], star.get_ydata()[0]) == (ref["gpus"], ref["seconds"])
    drawn = {p.get_gid(): p.get_height() for p in right.patches if p.get_gid()}
    crosses = {ln.get_gid() for ln in right.lines if ln.get_gid()}
    for r in rows:
        g = module.row_label(r)
        if "auto" in r:
            assert drawn[f"bar|autoshard|{g}"] == pytest.approx(100 * r["auto"]["mfu"])
        else:
            assert f"noplan|autoshard|{g}" in crosses
        priced = r.get("published", {}).get("priced", {}).get("microbatch_1")
        if priced and priced["oom"]:
            assert f"oom|megatron|{g}" in crosses and f"bar|megatron|{g}" not in drawn
        elif priced:
            assert drawn[f"bar|megatron|{g}"] == pytest.approx(100 * priced["mfu"])
    texts = " ".join(t.get_text() for t in right.texts)
    for r in rows:
        if "auto" in r:
            assert module.plan_label(r["auto"]).split("\n")[0] in texts
    module.figure.plt.close(fig)


def test_frontier_plan_label_names_each_view_of_a_mixed_plan():
    module = _script("frontier")
    mixed = FRONTIER_FAKE["data"]["rows"][1]["auto"]
    assert module.plan_label(mixed) == "8x32x4\n4x32x8\n(mixed)"
    assert module.plan_label({"tp_pp_dp": [8, 64, 6]}) == "8x64x6"


def test_offload_figure_is_built_from_the_committed_benchmark_json():
    """docs/figures/offload.json is what the builder makes of benchmarks/results/
    offload_v100.json; each panel draws a bar of the row's PFLOPS where it fits, a cross
    where not, a star on the fastest that fits and a line at the source figure's OOM row."""
    module = _script("offload")
    bench = json.loads((ROOT / "benchmarks/results/offload_v100.json").read_text())
    data = module.from_bench(bench, "benchmarks/results/offload_v100.json")
    committed = json.loads((FIGURES / "offload.json").read_text())
    assert committed["data"] == json.loads(json.dumps(data))
    fig, drawn = _drawn(module, committed)
    by_row = {(r["point"], r["offload"]): r for r in bench["rows"]}
    by_name = {p["point"]: p for p in data["points"]}
    assert [n for panel in data["panels"] for n in panel["points"]] == list(by_name)
    for ax, panel in zip(fig.axes, data["panels"], strict=True):
        title = ax.get_title()
        for p in (by_name[n] for n in panel["points"]):
            fitting = []
            for c in p["cells"]:
                row = by_row[(p["point"], c["offload"])]
                if len(panel["points"]) == 1:  # a bar per placement
                    key = f"offload|{module.TICKS[c['offload']]}"
                else:  # a group per point, a bar per placement
                    key = f"{c['offload']}|{p['title']}"
                if row["fits"]:
                    assert drawn[f"{title}::bar|{key}"][1] == row["pflops"]
                    fitting.append(row)
                else:
                    assert f"{title}::oom|{key}" in drawn
                    assert f"{title}::bar|{key}" not in drawn
            stars = [k for k in drawn if k.startswith(f"{title}::fastest|{p['point']}|")]
            if fitting:
                best = max(fitting, key=lambda r: r["pflops"])["offload"]
                assert stars == [f"{title}::fastest|{p['point']}|{best}"]
            else:
                assert stars == []
            line = next(ln for ln in ax.collections + ax.lines
                        if ln.get_gid() == f"reference|{p['point']}")  # fmt: skip
            y = line.get_segments()[0][0][1] if hasattr(line, "get_segments") else (
                line.get_ydata()[0])  # fmt: skip
            assert y == p["reference"]["pflops"] > 0
    # the claims docs/offload.md and docs/experiments.md make from it: every point but
    # gpt-39b's intra-only one fits under some placement, the fastest being these (with
    # the copies priced in series and 13% hidden, the host update where the f32 masters
    # would otherwise move too)
    best = {p["point"]: p["fastest_fit"] for p in data["points"]}
    omg = "optimizer,master,gradients"
    assert best == {
        "ablation": omg, "ablation:zero2:1": omg, "ablation:zero2:2": "optimizer",
        "ablation:zero2:4": "optimizer", "ablation:zero2:8": omg, "ablation:zero3:1": omg,
        "ablation:zero3:2": "optimizer", "weak:moe-27b:expert-zero2": omg,
        "weak:moe-70b:expert-zero2": omg, "weak:gpt-39b:intra-only": None,
    }  # fmt: skip


def test_offload_figure_says_which_benchmark_row_is_missing():
    module = _script("offload")
    bench = json.loads((ROOT / "benchmarks/results/offload_v100.json").read_text())
    rows = [r for r in bench["rows"] if (r["point"], r["offload"]) != ("ablation", "optimizer")]
    with pytest.raises(ValueError, match=r"no ablation row for \['optimizer'\].*offload_v100.py"):
        module.build(rows)


@pytest.mark.parametrize("name", ["truth", "sim-validation"])
def test_scatter_points_are_the_json(name):
    module = _script(name)
    doc = json.loads((FIGURES / f"{name}.json").read_text())
    fig = module.plot(doc)
    points = sorted(
        (round(float(x), 9), round(float(y), 9))
        for ax in fig.axes
        for coll in ax.collections
        if (coll.get_gid() or "").startswith("points|")
        for x, y in coll.get_offsets()
    )
    assert points == sorted((round(x, 9), round(y, 9)) for x, y in module.scatter_points(doc))


def test_reproduce_runs_scripts_and_writes_under_the_given_out(tmp_path, monkeypatch, capsys):
    """A relative --out is the caller's folder, not the scripts' (they run in experiments/)."""
    folder = tmp_path / "exps"
    folder.mkdir()
    (folder / "tiny.py").write_text(
        'NAME = "tiny"\nTITLE = "a tiny figure"\nSOURCE = "measured"\n'
        "import json, pathlib, sys\n"
        "out = pathlib.Path(sys.argv[sys.argv.index('--out') + 1])\n"
        "print('##progress 1 1 done', flush=True)\n"
        "(out / 'tiny.json').write_text(json.dumps({'quick': '--quick' in sys.argv}))\n"
    )
    (folder / "broken.py").write_text(
        'NAME = "broken"\nTITLE = "fails"\nSOURCE = "measured"\nraise SystemExit(3)\n'
    )
    monkeypatch.chdir(tmp_path)
    code = main(["reproduce", "--experiments", str(folder), "--quick", "--out", "rel", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 1  # one script failed
    assert {r["name"]: r["returncode"] for r in report["experiments"]} == {"broken": 3, "tiny": 0}
    assert json.loads((tmp_path / "rel" / "tiny.json").read_text()) == {"quick": True}
    assert "##progress 1 1 done" in (tmp_path / "rel" / "tiny.log").read_text()


@pytest.mark.heavy  # out of the default run; CI's heavy step runs it (.ci/run)
def test_weak_scaling_prices_every_method_with_the_familys_optimizer(monkeypatch):
    """Every method of a family (the search, intra-only, inter-only and the family's
    baseline) traces the step with the family's optimizer (Alpa's: SGD + Nesterov momentum
    for Wide-ResNet): each row says so, and each method's predicted peak is below the same
    method's with AdamW (one f32 buffer per parameter instead of two moments)."""
    module = _script("weak-scaling")
    assert module.OPTIMIZER == {"gpt": "adamw", "moe": "adafactor", "wresnet": "sgd-momentum"}
    monkeypatch.setattr(module, "SUITES", {"wresnet": [("wresnet-tiny", 2)]})
    monkeypatch.setattr(module, "CLUSTERS", ("alpa-v100",))
    monkeypatch.setattr(module, "GLOBAL_BATCH", {"wresnet": 16})
    peaks = {}
    for opt in ("sgd-momentum", "adamw"):
        monkeypatch.setitem(module.OPTIMIZER, "wresnet", opt)
        data = module.run(False, lambda *a: None)
        assert data["config"]["optimizer"] == {"wresnet": opt}
        assert {r["method"] for r in data["rows"]} == {
            "auto",
            "zero-dp",
            "intra-only",
            "inter-only",
        }
        assert {r["optimizer"] for r in data["rows"]} == {opt}
        peaks[opt] = {r["method"]: r["peak_bytes_per_device"] for r in data["rows"]}
    for method, peak in peaks["sgd-momentum"].items():
        assert peak < peaks["adamw"][method], method
    doc = {"data": data}  # the AdamW run's
    assert module.panel_title(doc, "alpa-v100", "wresnet") == "WRESNET on alpa-v100, AdamW"
    for r in data["rows"]:
        r["optimizer"] = "sgd-momentum"
    assert module.panel_title(doc, "alpa-v100", "wresnet") == (
        "WRESNET on alpa-v100, SGD + Nesterov 0.9"
    )


def test_chunk_assembly_records_each_chunks_optimizer(tmp_path):
    """benchmarks/weak_scaling_chunks.py --assemble: a chunk that recorded no optimizer
    (written before it was) counts as AdamW and says so; a family whose chunks differ is
    recorded per cluster, and each panel's title names its own rows' optimizer; likewise
    where the searches reduced gradients (``--grad-reduce``; none recorded: every
    micro-batch), and a run asked to reduce otherwise than a finished chunk did refuses it
    instead of skipping it."""
    import subprocess
    import sys

    def chunk(cluster, family, optimizer, grad_reduce=None):
        row = dict(cluster=cluster, family=family, model=f"{family}-x", gpus=1, method="auto",
                   pflops=1.0, oom=False, plan={}, step_time_s=1.0)  # fmt: skip
        config = {"global_batch": {}} | ({"optimizer": {family: optimizer}} if optimizer else {})
        config |= {"grad_reduce": {family: grad_reduce}} if grad_reduce else {}
        if optimizer:
            row["optimizer"] = optimizer
        doc = dict(config=config, rows=[row], chunk_wall_s=1.0, chunk_cpu_s=1.0, chunk_commit="x")
        (tmp_path / f"chunk-{cluster}-{family}.json").write_text(json.dumps(doc))

    for c in ("alpa-v100", "dgx-a100", "dgx-h100"):
        chunk(c, "gpt", None, "auto" if c == "dgx-h100" else None)
        chunk(c, "moe", "adafactor")
        chunk(c, "wresnet", "sgd-momentum" if c == "alpa-v100" else None)
    out = tmp_path / "out"
    script = ROOT / "benchmarks" / "weak_scaling_chunks.py"
    subprocess.run([sys.executable, str(script), str(tmp_path), "--assemble", str(out)], check=True)
    doc = json.loads((out / "weak-scaling.json").read_text())
    assert doc["data"]["config"]["optimizer"] == {
        "gpt": "adamw",
        "moe": "adafactor",
        "wresnet": {"alpa-v100": "sgd-momentum", "dgx-a100": "adamw", "dgx-h100": "adamw"},
    }
    assert doc["data"]["config"]["grad_reduce"] == {
        "gpt": {"alpa-v100": "microbatch", "dgx-a100": "microbatch", "dgx-h100": "auto"},
        "moe": "microbatch",
        "wresnet": "microbatch",
    }
    reduced = {(k["cluster"], k["family"]): k["grad_reduce"] for k in doc["data"]["chunks"]}
    assert reduced[("dgx-h100", "gpt")] == "auto" and reduced[("dgx-a100", "gpt")] == "microbatch"
    again = [sys.executable, str(script), str(tmp_path), "--families", "gpt", "--clusters"]
    refused = subprocess.run([*again, "dgx-a100", "--grad-reduce", "auto"], capture_output=True,
                             text=True)  # fmt: skip
    assert refused.returncode != 0 and "reduced gradients by microbatch, not auto" in refused.stderr
    skipped = subprocess.run([*again, "dgx-h100", "--grad-reduce", "auto"], check=True)
    assert skipped.returncode == 0  # finished with the same reduction: nothing to run
    recorded = {(k["cluster"], k["family"]): k["optimizer_recorded"] for k in doc["data"]["chunks"]}
    assert recorded[("alpa-v100", "gpt")] is False and recorded[("alpa-v100", "moe")] is True
    module = _script("weak-scaling")
    titles = {module.panel_title(doc, c, f) for c, f in module.panels(doc)}
    assert {"WRESNET on alpa-v100, SGD + Nesterov 0.9", "WRESNET on dgx-a100, AdamW"} <= titles
    assert "MOE on dgx-h100, Adafactor" in titles and (out / "weak-scaling.png").exists()
