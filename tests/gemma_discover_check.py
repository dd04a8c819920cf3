"""Run by ``test_discover_thirdparty_patterns`` in a subprocess: the gemma package replaces
flax's ``nn.Module.param`` process-wide, so it is imported only in ``main``; imported by pytest
(to look for doctests), this module does nothing.

``saggs.discover`` on a tiny ``gm.nn.Transformer`` (Gemma-2 layout, soft caps off): prints the
``repr`` of what it found, then the deviation of a NumPy orbit move of it (one line).
"""

import pathlib
import sys


def main():
  import jax
  import jax.numpy as jnp
  import numpy as np
  from gemma import gm

  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
  import models
  import saggs_jax as saggs
  from test_discover import orbit_move

  attention = gm.nn.config.AttentionType.GLOBAL
  config = gm.nn.config.TransformerConfig(
    num_embed=32,
    embed_dim=16,
    hidden_dim=24,
    num_heads=4,
    head_dim=4,
    num_kv_heads=2,
    final_logit_softcap=None,
    use_post_attn_norm=False,
    use_post_ffw_norm=False,
    attention_types=(attention, attention),
    transpose_gating_einsum=True,
  )
  model = gm.nn.Transformer(config=config, dtype=jnp.float32)
  tokens = jnp.asarray(np.random.default_rng(0).integers(1, 32, (2, 8)), jnp.int32)
  params = models.random_like(
    jax.eval_shape(model.init, jax.random.PRNGKey(0), tokens), 0, scale=0.5
  )

  def forward(params, tokens):
    return model.apply(params, tokens).logits

  found = saggs.discover(forward, params, tokens)
  with jax.default_matmul_precision("highest"):
    y0 = np.asarray(jax.jit(forward)(params, tokens))
    y1 = np.asarray(jax.jit(forward)(orbit_move(params, found), tokens))
  print(repr(found))
  print(float(np.max(np.abs(y1 - y0)) / np.max(np.abs(y0))))


if __name__ == "__main__":
  main()
