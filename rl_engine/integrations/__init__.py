"""The user entry points that put rl_engine's ops inside other code: `transformers` (patch a model), `trl`
(GRPOTrainer), `flash_attn` (flash-attn 2's API), `batch_invariant` (aten ops routed to batch-invariant kernels)
and `nn` (nn.Module layers). `rl_engine.flash_attn` and `rl_engine.nn` re-export the last two under their public
names."""
