"""The compiled masked CRC-32C that frames the TensorBoard event records (zosoma.training.crc32c)."""

import numpy as np
from tensorboardX.record_writer import masked_crc32c as tensorboardx_masked_crc32c

from zosoma.training.crc32c import _TABLE, _crc32c, masked_crc32c


def test_crc32c_check_value():
    """The standard check value of CRC-32C (Castagnoli): crc("123456789") = 0xE3069283."""
    assert int(_crc32c(np.frombuffer(b"123456789", np.uint8), _TABLE)) == 0xE3069283


def test_masked_crc32c_equals_tensorboardx_at_every_length():
    rng = np.random.default_rng(0)
    for n in [*range(0, 40), 255, 256, 300, 1000, 4097]:
        data = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        assert masked_crc32c(data) == tensorboardx_masked_crc32c(data), n
