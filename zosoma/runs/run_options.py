"""The options of scoring and sampling a run (`zosoma eval`, `zosoma sample`, zosoma.RunHandle.evaluate
and .sample), checked once here: the command line and the Python API refuse the same options in
the same words. An option of SOMA runs given for a single model (or the reverse) is refused, not
silently ignored; None is an option not given.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

from zosoma.errors import OptionError
from zosoma.mixture.sample import check_sampling
from zosoma.model.protocol import PROTOCOL, REROUTE_EVERY


def eval_options(run, streams=None, top_k=None, temperature=None, segment=None, context=None) -> dict:
    """The keywords of run.evaluate (zosoma.runs.run.Run) for the options given: the
    protocol, and the routing temperature and the streams where given."""
    _only_where_read(run, soma={"top_k": top_k, "temperature": temperature}, single={"streams": streams})
    given = {"segment": segment, "context": context, "top_k": top_k}
    checked = {"protocol": dataclasses.replace(PROTOCOL, **{k: v for k, v in given.items() if v is not None})}
    if streams is not None:
        checked["streams"] = _count("streams", streams)
    if temperature is not None:
        checked["temperature"] = _routing_temperature(temperature)
    return checked


def sample_options(run, n_bytes, temperature, seed, top_k=None, reroute_every=None) -> tuple[int, int]:
    """The (top_k, reroute_every) of sampling from `run`, the defaults for those not given, once
    every option is checked (zosoma.mixture.sample.check_sampling)."""
    _only_where_read(run, soma={"top_k": top_k, "reroute_every": reroute_every}, single={})
    top_k = PROTOCOL.top_k if top_k is None else dataclasses.replace(PROTOCOL, top_k=top_k).top_k
    reroute_every = REROUTE_EVERY if reroute_every is None else reroute_every
    check_sampling(n_bytes, temperature, seed, reroute_every)
    return top_k, reroute_every


def _only_where_read(run, soma: dict, single: dict) -> None:
    """The first option given that this kind of run does not read, refused by name."""
    given, what = ((single, f"single models; {run.path} is a SOMA run") if run.is_soma
                   else (soma, f"SOMA runs; {run.path} is a single model"))
    for name, value in given.items():
        if value is not None:
            raise OptionError(f"--{name.replace('_', '-')} is an option of {what}")


def _count(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise OptionError(f"{name} must be an integer, got {value!r}")
    if value < 1:
        raise OptionError(f"{name} must be at least 1, got {value}")
    return int(value)


def _routing_temperature(value) -> float:
    """T of the router's softmax(-d^2 / T): a positive finite number."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise OptionError(f"temperature must be a number, got {value!r}")
    if not (math.isfinite(value) and value > 0):
        raise OptionError(f"temperature must be a positive finite number (the router's softmax(-d^2 / T)), "
                          f"got {value}")
    return float(value)
