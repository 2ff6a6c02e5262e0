"""Server-side post-processing of the noisy aggregate: a server optimizer and an averaged release.

Each round the strategy averages the clients' noisy uploads into the aggregate ``a_t`` (what the
accountant charges). With ``server-optimizer`` the next server iterate is not ``a_t`` itself but an
optimizer step on the pseudo-gradient ``g_t = w_t - a_t`` (Flower's convention, FedAvgM / FedAdam
in ``flwr.serverapp.strategy``):

- ``momentum`` (FedAvgM, heavy ball): ``v_1 = g_1``, ``v_t = beta v_{t-1} + g_t``,
  ``w_{t+1} = w_t - lr v_t``; with beta = 0 and lr = 1 this is the plain aggregate.
- the step size ``lr`` of round t is ``server-lr`` x (1 - (1 - ``server-lr-end``) (t - 1) / (T - 1)):
  constant by default, else falling linearly to ``server-lr-end`` x ``server-lr`` at the last planned round T.
- ``adam`` (FedAdam): ``m_t = beta1 m_{t-1} - (1 - beta1) g_t``, ``v_t = beta2 v_{t-1} + (1 - beta2) g_t^2``
  (both from 0), ``w_{t+1} = w_t + lr sqrt(1 - beta2^s) / (1 - beta1^s) m_t / (sqrt(v_t) + tau)`` with
  s the number of optimizer steps so far (Kingma & Ba's bias correction; Flower uses the server
  round + 1 in place of s).
- ``server-weight-decay`` lambda (either optimizer): decoupled weight decay (Loshchilov & Hutter's AdamW),
  ``w_{t+1} = w_t - lr step_t - lr lambda w_t`` with ``lr`` the round's step size above and ``step_t`` the
  optimizer's step (``lr step_t`` is ``lr v_t`` for momentum): a pull of the iterate towards 0 that
  counters the random walk the per-round noise drives in flat directions of the loss.

With ``release-average`` the *released* model (central evaluation, the checkpoint's ``released``
copy, ``final_model.pt``, the strategy's ``Result``) is an average of the iterates, while the
clients always train from the iterate itself:

- ``ema``: the bias-corrected exponential moving average ``sum_s d^(t-s) w_s / sum_s d^(t-s)``
  over the iterates after applied rounds (decay d = ``release-ema-decay``);
- ``tail``: the running mean of the iterates after the applied rounds of the last
  ``ceil(release-tail-fraction * num-server-rounds)`` planned rounds (before they begin: the iterate).

Privacy: every output (weight decay included) is a function of the noisy aggregates the accountant already charged and
of the (public) initial model, so under the all-rounds threat model (every released model is
public) and the curious-server one (every upload is seen) it is post-processing: the privacy
report is the same with or without it (tests/strategies/test_server_opt.py checks it on the
in-process grid). Under the final-model threat model it is refused: that bound is a property of
the plain noisy-GD iterate (docs/MATH.md §2, §21), which neither a momentum iterate nor an average is.

Only floating-point arrays are optimized and averaged; any other array (e.g. an integer counter)
follows the aggregate. Buffers are float64; the released arrays keep the model's dtypes.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord

from fl_dp_flower.settings import FederationSettings

__all__ = ["ServerUpdate"]

#: run-config key of each FederationSettings field (refusal messages name what the user typed)
_KEYS = {"server_optimizer": "server-optimizer", "release_average": "release-average"}


class ServerUpdate:
    """The server iterate, the optimizer's buffers and the released average of one run."""

    def __init__(self, federation: FederationSettings, threat_model: str) -> None:
        if threat_model == "final-model":
            for field, key in _KEYS.items():
                if getattr(federation, field) != "none":
                    raise ValueError(
                        f"{field} ('{key}') = {getattr(federation, field)!r}: must be 'none' under threat-model "
                        "'final-model' (the final-model bound holds for the plain noisy-GD iterate only; "
                        "use 'all-rounds', under which server-side post-processing is free)")
        self.federation = federation
        self.iterate: ArrayRecord | None = None
        self.steps = 0  # optimizer steps taken (Adam's bias correction)
        self._m: list[np.ndarray] | None = None  # momentum vector / Adam's first moment
        self._v: list[np.ndarray] | None = None  # Adam's second moment
        self._avg: list[np.ndarray] | None = None  # EMA: the decayed sum; tail: the running mean
        self._weight = 0.0  # EMA: the decayed count; tail: the iterates in the mean

    @property
    def active(self) -> bool:
        return self.federation.post_processing

    def broadcast(self, arrays: ArrayRecord) -> ArrayRecord:
        """The model the clients train from: the server's iterate (``arrays``, what Flower holds
        between rounds, is the released model); the first call adopts ``arrays`` as the iterate."""
        if not self.active:
            return arrays
        if self.iterate is None:
            self.iterate = arrays
        return self.iterate

    def apply(self, current: ArrayRecord, aggregate: ArrayRecord, round_: int) -> ArrayRecord:
        """One applied round: the next iterate from the broadcast model ``current`` and the noisy
        ``aggregate`` of accounted round ``round_`` (1-based); returns the released model."""
        if not self.active:
            return aggregate
        keys = list(aggregate.keys())
        w, a = current.to_numpy_ndarrays(), aggregate.to_numpy_ndarrays()
        floats = [np.issubdtype(x.dtype, np.floating) for x in a]
        nxt = self._step(w, a, floats, round_) if self.federation.server_optimizer != "none" else a
        self.iterate = _record(keys, nxt, a)
        released = self._release(nxt, floats, round_)
        return self.iterate if released is None else _record(keys, released, a)

    # ------------------------------------------------------------------ optimizer
    def lr(self, round_: int) -> float:
        """The server's step size in accounted round ``round_``: 'server-lr' falling linearly to
        'server-lr-end' x 'server-lr' at the last planned round (and staying there)."""
        fed = self.federation
        progress = min(1.0, (round_ - 1) / (fed.num_server_rounds - 1)) if fed.num_server_rounds > 1 else 1.0
        return fed.server_lr * (1.0 - (1.0 - fed.server_lr_end) * progress)

    def _step(self, w: list[np.ndarray], a: list[np.ndarray], floats: list[bool], round_: int) -> list[np.ndarray]:
        fed = self.federation
        lr = self.lr(round_)
        g = [np.asarray(x, np.float64) - np.asarray(y, np.float64) if f else np.zeros(np.shape(y))
             for x, y, f in zip(w, a, floats)]
        self.steps += 1
        if fed.server_optimizer == "momentum":
            beta = fed.server_momentum
            self._m = g if self._m is None else [beta * m + gi for m, gi in zip(self._m, g)]
            new = [np.asarray(x, np.float64) - lr * m for x, m in zip(w, self._m)]
        else:  # adam; delta = -g (the update direction, Flower's delta_t)
            b1, b2, tau = fed.server_momentum, fed.server_adam_beta2, fed.server_adam_eps
            m0 = self._m if self._m is not None else [np.zeros_like(gi) for gi in g]
            v0 = self._v if self._v is not None else [np.zeros_like(gi) for gi in g]
            self._m = [b1 * m - (1 - b1) * gi for m, gi in zip(m0, g)]
            self._v = [b2 * v + (1 - b2) * gi * gi for v, gi in zip(v0, g)]
            eta = lr * math.sqrt(1 - b2 ** self.steps) / (1 - b1 ** self.steps)
            new = [np.asarray(x, np.float64) + eta * m / (np.sqrt(v) + tau) for x, m, v in zip(w, self._m, self._v)]
        if fed.server_weight_decay > 0.0:  # decoupled: lr lambda w_t, from the iterate before the step
            new = [n - lr * fed.server_weight_decay * np.asarray(x, np.float64) for n, x in zip(new, w)]
        return [n if f else y for n, y, f in zip(new, a, floats)]

    # ------------------------------------------------------------------ released model
    def tail_start(self) -> int:
        """First planned round whose iterate enters the tail average."""
        fed = self.federation
        return fed.num_server_rounds - math.ceil(fed.release_tail_fraction * fed.num_server_rounds - 1e-9) + 1

    def _release(self, w: list[np.ndarray], floats: list[bool], round_: int) -> list[np.ndarray] | None:
        kind = self.federation.release_average
        if kind == "none" or (kind == "tail" and round_ < self.tail_start()):
            return None
        x = [np.asarray(wi, np.float64) if f else wi for wi, f in zip(w, floats)]
        if self._avg is None:
            self._avg, self._weight = [xi.copy() for xi in x], 1.0
        elif kind == "ema":
            d = self.federation.release_ema_decay
            self._avg = [d * s + xi if f else xi for s, xi, f in zip(self._avg, x, floats)]
            self._weight = d * self._weight + 1.0
        else:  # tail: running mean
            self._weight += 1.0
            self._avg = [s + (xi - s) / self._weight if f else xi for s, xi, f in zip(self._avg, x, floats)]
        if kind == "ema":
            return [s / self._weight if f else s for s, f in zip(self._avg, floats)]
        return list(self._avg)

    # ------------------------------------------------------------------ checkpoint
    def state(self) -> dict[str, Any]:
        """What a resume needs to continue exactly: tensors and numbers (``torch.load(weights_only=True)``
        reads them back); empty when there is nothing to keep."""
        import torch

        if not self.active or self.iterate is None:
            return {}
        buffers = {name: None if value is None else [torch.from_numpy(np.asarray(x)) for x in value]
                   for name, value in (("m", self._m), ("v", self._v), ("avg", self._avg))}
        return {"iterate": dict(self.iterate.to_torch_state_dict()), "steps": self.steps, "weight": self._weight,
                **buffers}

    def restore(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state`'s output (a resume); an empty state starts afresh."""
        if not self.active or not state:
            return
        self.iterate = ArrayRecord(state["iterate"])
        self.steps, self._weight = int(state["steps"]), float(state["weight"])
        self._m, self._v, self._avg = ([x.numpy() for x in state[name]] if state[name] is not None else None
                                       for name in ("m", "v", "avg"))


def _record(keys: list[str], values: list[np.ndarray], like: list[np.ndarray]) -> ArrayRecord:
    """An ArrayRecord of ``values`` under ``keys``, each array cast to the dtype of ``like``'s."""
    return ArrayRecord({k: Array(np.asarray(v, dtype=ref.dtype)) for k, v, ref in zip(keys, values, like)})
