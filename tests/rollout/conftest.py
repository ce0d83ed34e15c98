import pytest

from rl_engine.checks.forward_invariance.harness import build_model
from rl_engine.models.config import ModelConfig
from rl_engine.models.weights import synthetic_weights

# One layer, V=64, H=32, 2 query heads on 1 KV head of 16: every op and tile border of the tiny config,
# at a size the Triton interpreter runs a whole rollout of in seconds.
MICRO = ModelConfig("rollout-micro", "qwen3", 64, 32, 64, 1, 2, 1, 16)


@pytest.fixture(scope="session")
def micro_config():
    return MICRO


@pytest.fixture(scope="session")
def micro_weights():
    return synthetic_weights(MICRO, 0)


@pytest.fixture(scope="session")
def micro_model(micro_weights):
    """Factory: the micro model under a profile (built once per profile)."""
    built = {}

    def get(profile: str):
        if profile not in built:
            built[profile] = build_model(MICRO, micro_weights, profile)
        return built[profile]

    return get
