"""Plan, run and verify a Flax model you write yourself, on 8 fake CPU devices.

Run: ``python examples/own_model.py [OUT.json]``. Prints whether the plan's predictions
agree with what XLA compiled, and the losses of three sharded steps next to the same
steps on one device; saves the
plan to OUT.json (default ``own_model_plan.json``) for ``autoshard explain`` and
``autoshard export``. See docs/own-model.md.
"""

import sys

import jax

jax.config.update("jax_num_cpu_devices", 8)  # 8 fake CPU devices; leave out on a GPU host

import flax.linen as nn  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import autoshard  # noqa: E402


class TwoLayerMLP(nn.Module):  # your model: any Flax linen module
    @nn.compact
    def __call__(self, x):  # x: [batch, 64]
        return nn.Dense(64)(nn.relu(nn.Dense(512)(x)))


model, opt = TwoLayerMLP(), optax.adamw(1e-3)
batch = (jnp.ones((32, 64)), jnp.zeros((32, 64)))  # (inputs, targets)
params = model.init(jax.random.key(0), batch[0])


def step(params, opt_state, batch):  # one training step -> (params, opt_state, loss)
    loss_fn = lambda p: jnp.mean((model.apply(p, batch[0]) - batch[1]) ** 2)  # noqa: E731
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


if __name__ == "__main__":
    out = sys.argv[1] if len(sys.argv) > 1 else "own_model_plan.json"
    bound = autoshard.auto_shard(step, params, opt.init(params), batch, mesh="2x4")  # plan
    report = bound.verify()  # compile, compare predicted with compiled
    print("agrees with XLA:", report.collectives_agree, f"(memory error {report.memory_error:.1%})")
    state, one_device = (params, opt.init(params)), (params, opt.init(params))
    sharded_step, plain_step = bound.jit(donate=False), jax.jit(step)  # sharded vs one device
    for i in range(3):
        *state, loss = sharded_step(*state, batch)
        *one_device, want = plain_step(*one_device, batch)
        print(f"step {i}: loss {float(loss):.6f} sharded, {float(want):.6f} on one device")
    bound.save(out)  # then: autoshard explain OUT.json --html plan.html
    print(f"plan saved to {out}")
