"""GPU check: the init program compiled with JAX's threefry GPU kernel lowering gives the same bits as the
default lowering (`reduced`, 4 layers), and how long each compiles.

    python3 benchmarks/init_threefry_identity.py OUT.json     # on a GPU machine; on a CPU both are the default

Result: experiments/results/init_threefry_kernel_identity_<device>.json (provenance added there).
"""
import hashlib, json, sys, time
import jax, numpy as np
from turbo_moe.model import get_config
from turbo_moe.train import TrainConfig
from turbo_moe.train.init_program import InitProgram
from turbo_moe.train.step import build_program, make_mesh, make_optimizer

cfg = get_config("reduced", moe_path="turbo", n_layers=4)
tx = make_optimizer(TrainConfig(model=cfg, dataset="synthetic", seq_len=2048))
program = build_program(cfg, tx, make_mesh(jax.devices()[:1]), True, None)
digests, out = {}, {}
for mode in ("on", "off"):
    init = InitProgram(program.init.jitted, mode)
    t0 = time.perf_counter(); compiled = init.compile(jax.random.key(0)); t = time.perf_counter() - t0
    state = jax.block_until_ready(compiled(jax.random.key(0)))
    h = hashlib.sha256()
    for leaf in jax.tree.leaves(state):
        h.update(np.asarray(jax.device_get(leaf)).tobytes())
    digests[mode] = h.hexdigest()
    out[mode] = {"compile_s": round(t, 2), "choice": init.last_choice, "sha256": digests[mode]}
    del state, compiled
out["identical"] = digests["on"] == digests["off"]
print(json.dumps(out, default=str))
json.dump(out, open(sys.argv[1], "w"), default=str, indent=1)
