"""A JAX run saving with Orbax's CheckpointManager as its users do: async saves, metrics and a
best_fn. argv: DIR STEP... [--restore STEP] (restore only: print the restored weights' sum).
On the CPU; one process."""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp


def params_at(step: int) -> dict[str, jax.Array]:
    key = jax.random.PRNGKey(step)
    return {"w": jax.random.normal(key, (256, 256)), "b": jnp.full((256,), float(step))}


def main() -> None:
    path, rest = sys.argv[1], sys.argv[2:]
    opts = ocp.CheckpointManagerOptions(max_to_keep=10, best_fn=lambda m: m["loss"],
                                        best_mode="min", enable_async_checkpointing=True)
    with ocp.CheckpointManager(path, options=opts) as mngr:
        if rest[0] == "--restore":
            step = int(rest[1])
            got = mngr.restore(step, args=ocp.args.StandardRestore(params_at(step)))
            want = params_at(step)
            same = all(bool(jnp.array_equal(got[k], want[k])) for k in want)
            print(json.dumps({"step": step, "same": same, "latest": mngr.latest_step()}))
            return
        for step in map(int, rest):
            # loss is lowest at step 200: "best" is not simply the latest
            loss = {100: 0.5, 200: 0.1, 300: 0.3}.get(step, 1.0)
            mngr.save(step, args=ocp.args.StandardSave(params_at(step)),
                      metrics={"loss": loss, "accuracy": 1 - loss})
            print(f"saving {step}", flush=True)
        mngr.wait_until_finished()
        print("done", flush=True)


if __name__ == "__main__":
    main()
