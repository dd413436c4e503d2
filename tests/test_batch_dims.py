"""The batch-dim analysis behind force_batch_dim_to_mesh_axis (Alpa's batch-dim map), and
the rule it drives: every dot and every data input keeps its batch dim on the axis."""

import jax
import jax.numpy as jnp
import pytest

from autoshard.hardware.mesh import alpa_test_mesh
from autoshard.intra.problem.batch_dims import batch_dim_map
from autoshard.intra.problem.build import auto_shard_graph
from autoshard.intra.problem.options import IntraOptions
from autoshard.ir.graph import build_graph
from autoshard.trace.jaxpr import trace_train_step

BATCH, IN, HIDDEN, OUT = 32, 8, 16, 4


def _mlp_graph(batch=BATCH, transpose_input=False, hidden=HIDDEN):
    """A 2-layer MLP's SGD step (relu between, squared error); with ``transpose_input``
    the data input is fed feature-major, (IN, batch), and transposed inside."""

    def loss(p, b):
        x = b["x"].T if transpose_input else b["x"]
        h = jax.nn.relu(x @ p["w1"] + p["b1"])
        return jnp.mean((h @ p["w2"] - b["y"]) ** 2)

    def step(params, opt_state, b):
        grads = jax.grad(loss)(params, b)
        new = jax.tree.map(lambda w, g: w - 0.1 * g, params, grads)
        return new, opt_state, loss(params, b)

    params = {
        "w1": jnp.zeros((IN, hidden)),
        "b1": jnp.zeros((hidden,)),
        "w2": jnp.zeros((hidden, OUT)),
    }
    x = jnp.zeros((IN, batch) if transpose_input else (batch, IN))
    b = {"x": x, "y": jnp.zeros((batch, OUT))}
    return build_graph(trace_train_step(step, params, (), b).records)


@pytest.fixture(scope="module")
def mlp():
    return _mlp_graph()


def test_every_activation_carries_the_batch_at_dim_0_and_no_weight_does(mlp):
    g = mlp
    batch = batch_dim_map(g)
    for tid in g.inputs:
        t = g.tensors[tid]
        assert (tid in batch) == (t.kind == "data"), t.path
        assert batch.get(tid, 0) == 0
    dots = [n for n in g.nodes if n.primitive == "dot_general"]
    kinds = set()
    for n in dots:
        out = g.tensors[n.outputs[0]]
        if out.shape[0] == BATCH:  # activations and their gradients: (BATCH, features)
            assert batch[n.outputs[0]] == 0, (n.index, out.shape)
            kinds.add("activation")
        else:  # weight gradients contract the batch: free
            assert n.outputs[0] not in batch, (n.index, out.shape)
            kinds.add("weight gradient")
    assert kinds == {"activation", "weight gradient"}
    # the (B, HIDDEN) activations all carry it (but a dead broadcast nothing reads); no
    # (IN, HIDDEN) / (HIDDEN,) value does
    dead = g.dead_nodes()
    for n in g.nodes:
        for tid in n.outputs:
            shape = g.tensors[tid].shape
            if shape in ((IN, HIDDEN), (HIDDEN, OUT), (HIDDEN,), ()):
                assert tid not in batch, (n.primitive, shape)
            if shape == (BATCH, HIDDEN) and n.index not in dead:
                assert batch.get(tid) == 0, (n.primitive, shape)


def test_a_transpose_moves_the_batch_dim():
    g = _mlp_graph(transpose_input=True)
    batch = batch_dim_map(g)
    x = next(t for t in g.inputs if g.tensors[t].path.endswith("['x']"))
    assert g.tensors[x].shape == (IN, BATCH)
    # seeded at dim 0 as a data input (autoshard's seed), and the first dot's result at
    # dim 0 (Alpa's): the transpose between maps the batch of its result back onto dim 1
    # of x only where x has none yet -- x keeps its seed
    assert batch[x] == 0
    transposes = [n for n in g.nodes if n.primitive == "transpose" and n.inputs[0] == x]
    assert transposes and batch[transposes[0].outputs[0]] == 1
    first_dot = next(n for n in g.nodes if n.primitive == "dot_general")
    assert batch[first_dot.outputs[0]] == 0


def _dot_batch_axes(g, plan, batch):
    """The axes each dot with a (batch, ...) result splits its dim 0 over."""
    return {
        n.index: plan.tensor_specs[n.outputs[0]].dims[0]
        for n in g.nodes
        if n.primitive == "dot_general" and g.tensors[n.outputs[0]].shape[0] == batch
        and n.outputs[0] in plan.tensor_specs
    }  # fmt: skip


@pytest.fixture(scope="module")
def wide():
    """A wide MLP on a small batch: its free optimum is model parallel (Megatron's
    column- then row-split), not data parallel (checked below)."""
    return _mlp_graph(batch=8, hidden=512)


@pytest.fixture(scope="module")
def tall():
    """A narrow MLP on a large batch: its free optimum is data parallel."""
    return _mlp_graph(batch=1024)


@pytest.mark.parametrize(
    "graph, batch, shape, want",
    [("wide", 8, (2, 4), ("model",)), ("tall", 1024, (1, 4), ())],
)
def test_every_dot_with_a_batch_keeps_it_on_the_forced_axis(request, graph, batch, shape, want):
    """On 2x4 every batch dim of a dot is split over 'model' alone, where the wide MLP's
    free plan is model parallel; forced onto an axis of one device (1x4: 'data'), none
    is split, where a tall batch's free plan splits the batch over 'model'."""
    g = request.getfixturevalue(graph)
    mesh = alpa_test_mesh(shape, ("data", "model"))
    axis = "model" if shape[0] > 1 else "data"
    options = IntraOptions(time_limit_s=None)
    free = _dot_batch_axes(g, auto_shard_graph(g, mesh, options), batch)
    assert free and any(d != want for d in free.values()), free  # the rule binds
    plan = auto_shard_graph(g, mesh, options.replace(force_batch_dim_to_mesh_axis=axis))
    got = _dot_batch_axes(g, plan, batch)
    assert got and all(d == want for d in got.values()), got
    assert not any(
        c.kind == "all-gather" and axis in c.axes and shape[0] > 1
        for c in plan.predicted_collectives
    )


def test_an_undivided_batch_is_refused_naming_the_value():
    g = _mlp_graph(batch=6)
    mesh = alpa_test_mesh((2, 4), ("data", "model"))
    with pytest.raises(ValueError, match=r"batch dim \(dim 0\) of data input .* not divisible "
                       r"by the 4 devices of axis 'model'"):  # fmt: skip
        auto_shard_graph(g, mesh, IntraOptions(force_batch_dim_to_mesh_axis="model"))


def test_batched_dots_and_reshapes():
    """A batched dot keeps the batch on its batch dim; a reshape keeps it where the dims
    up to it are unchanged, not where it merges the batch with the next dim (Alpa keeps
    it there too: the deviation its docstring names)."""
    B, S, H = 4, 6, 8

    def loss(p, b):
        q = b["x"] @ p["w"]  # (B, S, H)
        scores = jnp.einsum("bsh,bth->bst", q, b["x"])  # batch dim b
        flat = scores.reshape(B, S * S)  # keeps dim 0
        merged = q.reshape(B * S, H)  # merges it: no batch
        return jnp.sum(flat) + jnp.sum(merged @ p["v"])

    def step(params, opt_state, b):
        grads = jax.grad(loss)(params, b)
        return jax.tree.map(lambda w, g: w - g, params, grads), opt_state, loss(params, b)

    params = {"w": jnp.zeros((H, H)), "v": jnp.zeros((H, 2))}
    g = build_graph(trace_train_step(step, params, (), {"x": jnp.zeros((B, S, H))}).records)
    batch = batch_dim_map(g)
    fwd = [n for n in g.nodes if n.phase == "forward"]
    dots = [n for n in fwd if n.primitive == "dot_general"]
    shapes = [g.tensors[n.outputs[0]].shape for n in dots]
    assert shapes == [(B, S, H), (B, S, S), (B * S, 2)], shapes
    assert [batch.get(n.outputs[0]) for n in dots] == [0, 0, None]
    reshapes = {g.tensors[n.outputs[0]].shape: n.outputs[0] for n in fwd
                if n.primitive == "reshape"}  # fmt: skip
    assert batch[reshapes[(B, S * S)]] == 0 and reshapes[(B * S, H)] not in batch


def test_the_forced_axis_forbids_all_gathers_over_it_alone():
    from autoshard.intra.problem.options import collective_forbidden

    forbidden = IntraOptions(force_batch_dim_to_mesh_axis="x").forbidden_collectives()
    assert collective_forbidden("all-gather", ("x",), forbidden)
    assert collective_forbidden("all-gather", ("x", "y"), forbidden)
    assert not collective_forbidden("all-gather", ("y",), forbidden)
    assert not collective_forbidden("all-reduce", ("x",), forbidden)
    assert IntraOptions().forbidden_collectives() == frozenset()
