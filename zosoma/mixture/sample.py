"""Sampling text from a routed SOMA ensemble.

Each next byte is drawn from the routed mixture p = sum_i w_i p_i of the selected experts, sharpened
or flattened by `temperature` as a whole: q proportional to p^(1 / temperature) (the temperature
acts on the mixture, not on each expert); temperature 0 is greedy decoding, the most likely byte
of the mixture (the lowest byte value on a tie), and draws nothing. The router re-routes every `reroute_every` generated
bytes on the last `context` bytes of prompt + generated text:

- an expert kept by a re-route carries its state on (it has read everything since it was chosen);
- an expert newly chosen starts from zero state and warms up on the last `context` bytes, as in
  routed evaluation (zosoma.mixture.routing);
- the weights of all selected experts are replaced by the new routing.

The experts never saw a start-of-text symbol, so an EMPTY prompt is read as a single newline (the
most neutral boundary byte in text): the experts' first input is b"\\n", which is not returned.
The router sees only real text, so it routes an empty prompt by the no-information rule of
zosoma.mixture.routing (equal weights on the broadest clusters) until text exists at the next re-route.

Randomness: one generator, np.random.default_rng([seed, 0x5A4]), one uniform draw per byte, so
the same ensemble, prompt and seed give the same bytes on any machine with the same float32
arithmetic. On a GPU engine (zosoma.engines.cuda.cuda_ops) the experts' float32
rounding differs from the CPU's in the last bits: a draw that falls on a boundary of the
cumulative distribution can then pick another byte.
"""

from __future__ import annotations

import math

import numpy as np

from zosoma.engines.ops import Ops
from zosoma.errors import OptionError
from zosoma.mixture.routing import Ensemble
from zosoma.model.protocol import PROTOCOL, REROUTE_EVERY

_STREAM = 0x5A4  # random stream of sampling (params use 0x1D1)
_START = b"\n"  # the experts' first input when the prompt is empty
MAX_BYTES = 1 << 30  # a request beyond 1 GiB is a typo (1e12 would take years: a forward per byte)


def check_sampling(n_bytes, temperature, seed=0, reroute_every=REROUTE_EVERY, context=PROTOCOL.context) -> float:
    """Sampling's options checked (an OptionError in one line naming the first bad one); the
    temperature as a float."""
    for name, value, least in (("n_bytes", n_bytes, 0), ("seed", seed, 0), ("reroute_every", reroute_every, 1),
                               ("context", context, 1)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < least:
            raise OptionError(f"{name} must be an integer >= {least}, got {value!r}")
    if n_bytes > MAX_BYTES:
        raise OptionError(f"n_bytes must be at most {MAX_BYTES:,} (1 GiB), got {n_bytes:,}")
    try:
        temperature = float(temperature)
    except (TypeError, ValueError):
        raise OptionError(f"sampling temperature must be a number, got {temperature!r}") from None
    if not (math.isfinite(temperature) and temperature >= 0):
        raise OptionError(f"sampling temperature must be a finite number >= 0 (0: greedy), got {temperature}")
    return temperature


class _Active:
    """One selected expert: its recurrent state and its log-probabilities (V,) of the next byte."""

    def __init__(self, theta, layout, history: np.ndarray, log_probs):
        self.theta, self.layout, self.log_probs = theta, layout, log_probs
        logp, self.state = log_probs(theta, layout, history[None])  # warm-up from zero state
        self.logp = logp[0, -1]

    def feed(self, byte: int) -> None:
        logp, self.state = self.log_probs(self.theta, self.layout, np.array([[byte]], np.uint8), self.state)
        self.logp = logp[0, -1]


def prompt_bytes(prompt) -> bytes:
    """A prompt as the experts read it: bytes as they are, text as UTF-8; anything else (an int,
    which bytes() would read as that many NUL bytes) is refused."""
    if isinstance(prompt, str):
        return prompt.encode("utf-8")
    if isinstance(prompt, (bytes, bytearray, memoryview)):
        return bytes(prompt)
    raise OptionError(f"prompt must be bytes or text, got {prompt!r}")


def sample(ensemble: Ensemble, prompt: bytes = b"", n_bytes: int = 400, temperature: float = 0.8,
           seed: int = 0, reroute_every: int = REROUTE_EVERY, context: int = PROTOCOL.context,
           ops: Ops | None = None) -> bytes:
    """The n_bytes generated after `prompt` (the prompt itself is not repeated); the experts run
    on the engine `ops` (zosoma.engines; default the CPU)."""
    return b"".join(generate(ensemble, prompt, n_bytes, temperature, seed, reroute_every, context, ops))


def generate(ensemble: Ensemble, prompt: bytes = b"", n_bytes: int = 400, temperature: float = 0.8,
             seed: int = 0, reroute_every: int = REROUTE_EVERY, context: int = PROTOCOL.context,
             ops: Ops | None = None):
    """sample's bytes one at a time, as each is drawn (the options are checked before the first)."""
    temperature = check_sampling(n_bytes, temperature, seed, reroute_every, context)
    return _generate(ensemble, prompt_bytes(prompt), n_bytes, temperature, seed, reroute_every, context, ops or Ops())


def _generate(ensemble, prompt: bytes, n_bytes, temperature, seed, reroute_every, context, ops):
    ensemble = ensemble.on(ops)  # weights copied to the device once, not at every byte
    rng = np.random.default_rng([seed, _STREAM])
    text = bytearray(prompt)  # what the router sees
    stream = bytearray(prompt or _START)  # what the experts read
    active: dict[int, _Active] = {}
    weights: dict[int, float] = {}

    def route():
        experts, w = ensemble.router.select([bytes(text[-context:])])
        history = np.frombuffer(bytes(stream[-context:]), np.uint8)
        chosen = {int(e): float(x) for e, x in zip(experts[0], w[0])}
        for i in list(active):
            if i not in chosen:
                del active[i]
        for i in chosen:
            if i not in active:
                active[i] = _Active(*ensemble.experts[i], history, ops.log_probs)
        weights.clear()
        weights.update(chosen)

    for t in range(n_bytes):
        if t % reroute_every == 0:
            route()
        ids = sorted(active)
        with np.errstate(divide="ignore"):  # a weight that underflowed to 0 adds nothing
            logw = np.log(np.array([weights[i] for i in ids], np.float64))
        logp = np.stack([active[i].logp for i in ids]).astype(np.float64)  # (K, V)
        x = logw[:, None] + logp
        m = x.max()
        mix = m + np.log(np.exp(x - m).sum(axis=0))  # (V,) log of the mixture
        if temperature == 0:
            byte = int(np.argmax(mix))
        else:
            z = mix / temperature
            q = np.exp(z - z.max())
            cdf = np.cumsum(q)
            byte = int(min(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"), cdf.size - 1))
        yield bytes((byte,))
        text.append(byte)
        stream.append(byte)
        if t + 1 < n_bytes:
            for i in ids:
                active[i].feed(byte)
