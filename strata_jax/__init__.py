"""strata_jax: pure, jitted training library for long-horizon LLM agents."""
