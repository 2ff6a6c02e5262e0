"""Client side of the SecAgg+ bridge (docs/ARCHITECTURE.md "Secure aggregation"; experimental).

``ClientApp(mods=[secaggplus_mod, secure_upload_mod])``: Flower's ``secaggplus_mod`` answers the
protocol's setup, share-keys and unmask stages itself; at collect-masked-vectors it calls the next
handler with the strategy's own train content (``arrays``, ``config``) and expects a legacy FitRes
back, which it quantizes, masks and uploads (clearing the arrays). This mod sits between the two:
it calls our train handler and turns its reply (the noisy model w_t + Delta + noise) into a FitRes
holding the noisy **update** (Delta + noise, in the state_dict's order; bounded by B + noise, the
range of docs/MATH.md §20.4), ``num_examples = 1`` (uniform weights with ``max_weight = 1``) and the
reply's metrics (the echoes), which travel in the clear. A refusal or error reply passes through.

Values outside SecAgg+'s clipping range ±R (from the protocol's setup stage) are counted and logged
on the client (:data:`CLIPPED_LOG`); the count is not sent: it is a function of this client's own
upload, which the server must not learn beyond the sum.
"""

from __future__ import annotations

import logging

import numpy as np
from flwr.app import Context, Message
from flwr.app.message_type import MessageType
from flwr.clientapp.typing import ClientAppCallable
from flwr.common import Code, FitRes, Status, ndarrays_to_parameters
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, RECORD_KEY_STATE
from flwr.compat.common.recorddict_compat import fitres_to_recorddict

__all__ = ["CLIPPED_LOG", "clipped_values", "secure_upload_mod"]

log = logging.getLogger(__name__)
#: the client's log line when SecAgg+ will clip some of its values (count, R)
CLIPPED_LOG = "secure aggregation: %d value(s) of this upload lie outside the quantization range +-%g and are clipped"


def clipped_values(update: list[np.ndarray], clip_range: float) -> int:
    """How many values of ``update`` Flower's quantization clips to [-R, R] (exactly: |x| > R)."""
    return sum(int(np.count_nonzero(np.abs(a) > clip_range)) for a in update)


def secure_upload_mod(msg: Message, ctxt: Context, call_next: ClientAppCallable) -> Message:
    """Our train reply as the legacy FitRes SecAgg+ masks: the noisy update, weight 1, the echoes."""
    if msg.metadata.message_type != MessageType.TRAIN or RECORD_KEY_CONFIGS not in msg.content.config_records \
            or "arrays" not in msg.content.array_records:
        return call_next(msg, ctxt)
    reply = call_next(msg, ctxt)
    if reply.has_error() or "arrays" not in reply.content.array_records:
        return reply
    sent = msg.content.array_records["arrays"]
    upload = reply.content.array_records["arrays"]
    update = [np.asarray(upload[k].numpy(), dtype=np.float64) - np.asarray(sent[k].numpy(), dtype=np.float64)
              for k in sent.keys()]
    protocol_state = ctxt.state.config_records.get(RECORD_KEY_STATE)
    clip_range = protocol_state.get("clipping_range") if protocol_state is not None else None
    if isinstance(clip_range, float) and clip_range > 0:
        clipped = clipped_values(update, clip_range)
        if clipped:
            log.warning(CLIPPED_LOG, clipped, clip_range)
    metrics = dict(reply.content.metric_records["metrics"]) if "metrics" in reply.content.metric_records else {}
    fitres = FitRes(status=Status(code=Code.OK, message="OK"), parameters=ndarrays_to_parameters(update),
                    num_examples=1, metrics=metrics)  # type: ignore[arg-type]  # echoes: scalars and int lists
    return Message(fitres_to_recorddict(fitres, keep_input=False), reply_to=msg)
