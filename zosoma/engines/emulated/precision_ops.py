"""The low-precision engine: every forward emulated in bf16, fp16 or int8 on the CPU.

What a forward-only device with a narrow number format computes (zosoma.model.number_formats is the
specification; zosoma.engines.emulated.precision_kernels runs it compiled). The master weights and the
update stay fp32 on the host (Ops' updates); each member of a step is a perturbed fp32 COPY of
theta (ForwardOnlyOps), which the forward rounds or quantises, so theta never passes through the
format and the plus/minus round trip of MeZO's in-place perturbation, which loses low bits in
fp16, cannot happen. Evaluation (nll_stream) runs in the format too: the held-out figures of a
run are what the device would measure. Sampling (log_probs) stays in fp32 on the host.

Activity perturbation (ForwardOnlyOps' hooks): the members' noisy forward is compiled
(precision_kernels.noisy_nats: the noise added to each pre-activation's accumulator before the
format rounds it, as a device adds it before the nonlinearity); the clean forward whose inputs the
outer products read runs in the format too (precision_reference.clean_inputs: one model of B rows);
the noise, the outer products and the update stay fp32 on the host.
"""

from __future__ import annotations

import numpy as np

from zosoma.engines.forward_only import ForwardOnlyOps
from zosoma.engines.emulated import precision_kernels, precision_reference
from zosoma.model.params import Layout
from zosoma.model.number_formats import check_format


class PrecisionOps(ForwardOnlyOps):
    """Ops whose forwards are emulated in `fmt` ("bf16", "fp16" or "int8")."""

    def __init__(self, fmt: str):
        check_format(fmt)
        if fmt == "fp32":
            raise ValueError("fp32 is the CPU engine itself (zosoma.engines.get_ops)")
        self.precision = fmt
        self.name = f"cpu-{fmt}"

    def population_loss(self, thetas, layout: Layout, batch) -> np.ndarray:
        return precision_kernels.population_loss(thetas, layout, batch, self.precision)

    def nll_stream(self, theta, layout: Layout, tokens, targets, state=None, scored_from: int = 0):  # every column
        return precision_kernels.nll_stream(theta, layout, tokens, targets, self.precision, state)

    def noisy_nats(self, theta, layout: Layout, batch, scale: float, Z, index, sign) -> np.ndarray:
        return precision_kernels.noisy_nats(theta, layout, batch, self.precision, scale, Z, index, sign)

    def clean_inputs(self, theta, layout: Layout, batch, probs: bool = False):
        return precision_reference.clean_inputs(theta, layout, batch, self.precision, probs)
