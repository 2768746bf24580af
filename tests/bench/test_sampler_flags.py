"""The sampler benchmark's `--batches` flag: bad values are refused by name before anything runs."""

import pytest

from opd_jax.bench import sampler


@pytest.mark.parametrize("value", ["0", "1,x", ","])
def test_bad_batches_named(value):
  with pytest.raises(ValueError, match="--batches"):
    sampler.main([f"--batches={value}", "--models=tiny", "--kinds=fp8_vs_dense"])
