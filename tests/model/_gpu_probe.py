"""Temporary GPU probe (not a test): reduced-config train step memory/speed per MoE path."""
import sys, time, traceback
import jax, jax.numpy as jnp, optax, flax
from flax import nnx
sys.path.insert(0, ".")
from turbo_moe.model import get_config, DeepSeekModel, lm_loss, count_params, flops_per_token

path, batch_size, remat = sys.argv[1], int(sys.argv[2]), sys.argv[3]
seq = 2048
cfg = get_config("reduced", moe_path=path, remat_policy=remat)
print("jax", jax.__version__, "flax", flax.__version__, jax.devices()[0].device_kind, path, batch_size, remat, flush=True)
from turbo_moe.model.layers import causal_attention
q = jnp.zeros((1, 256, 4, 96), jnp.bfloat16); v = jnp.zeros((1, 256, 4, 64), jnp.bfloat16)
hlo = jax.jit(lambda q, k, v: causal_attention(q, k, v, "auto")).lower(q, q, v).compile().as_text()
print("cudnn attention used:", "cudnn" in hlo.lower(), flush=True)
try:
    model = DeepSeekModel(cfg, rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.adamw(1e-4), wrt=nnx.Param)

    @nnx.jit(donate_argnums=(0, 1))
    def step(model, opt, batch):
        (loss, metrics), grads = nnx.value_and_grad(lm_loss, has_aux=True)(model, batch)
        opt.update(model, grads)
        return loss, metrics

    tok = jax.random.randint(jax.random.key(0), (batch_size, seq + 1), 0, cfg.vocab_size)
    batch = {"inputs": tok[:, :-1], "targets": tok[:, 1:]}
    t = time.time(); loss, m = step(model, opt, batch); loss.block_until_ready(); compile_s = time.time() - t
    t = time.time()
    for _ in range(5):
        loss, m = step(model, opt, batch)
    loss.block_until_ready(); dt = (time.time() - t) / 5
    tokens = batch_size * seq
    tflops = flops_per_token(cfg, seq) * tokens / dt / 1e12
    peak = jax.devices()[0].memory_stats().get("peak_bytes_in_use", -1) / 2**30
    print(f"RESULT {path} B={batch_size} remat={remat}: compile {compile_s:.0f}s step {dt*1e3:.0f} ms "
          f"{tokens/dt:.0f} tok/s {tflops:.0f} TFLOP/s peak {peak:.1f} GiB loss {float(loss):.3f} "
          f"dropped {float(m['dropped_fraction']):.3f}", flush=True)
except Exception as err:
    print(f"RESULT {path} B={batch_size} remat={remat}: FAILED {type(err).__name__}: {str(err)[:400]}", flush=True)
