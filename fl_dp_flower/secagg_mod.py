"""Client side of secure aggregation (docs/ARCHITECTURE.md "Secure aggregation").

``ClientApp(mods=[secure_aggregation_mod])`` is all a ClientApp needs (the reference app has it): SecAgg+
messages go through Flower's ``secaggplus_mod`` and :func:`secure_upload_mod`, every other message
passes unchanged. In detail, ``secure_aggregation_mod`` is
``ClientApp(mods=[secaggplus_mod, secure_upload_mod])``: Flower's ``secaggplus_mod`` answers the
protocol's setup, share-keys and unmask stages itself; at collect-masked-vectors it calls the next
handler with the strategy's own train content (``arrays``, ``config``, the latter with the grid
keys ``dp.sum-grid-*`` that :class:`~fl_dp_flower.strategies.secagg.SecAggGrid` adds) and expects a
legacy FitRes back, which it quantizes, masks and uploads. This mod sits between the two: it calls
our train handler, whose reply holds the integer upload k = clamp(round(Delta/s) + Skellam) + 2^29
(``protocol.SECURE_SUM_RECORD``, :func:`fl_dp_flower.client.secure_sum_update`), and hands it to
Flower as the floats that its quantization maps to exactly k (training/secure_sum.py), weight 1
(uniform average), with the reply's metrics (the echoes, which travel in the clear).

A train handler that answers with a float model instead (one that ignores the grid) gets an error
reply: its upload would be rounded by Flower, a term no bound accounts. A refusal or error reply
passes through unchanged.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from flwr.app import Context, Error, Message
from flwr.app.message_type import MessageType
from flwr.client.mod import secaggplus_mod
from flwr.clientapp.typing import ClientAppCallable
from flwr.common import Code, FitRes, Status, ndarrays_to_parameters
from flwr.common.constant import ErrorCode
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS
from flwr.compat.common.recorddict_compat import fitres_to_recorddict

from fl_dp_flower.protocol import SECURE_SUM_RECORD, secure_echo
from fl_dp_flower.training.secure_sum import to_flower_values

__all__ = ["NOT_ON_THE_GRID", "secure_aggregation_mod", "secure_upload_mod"]

#: the error reason when the train handler did not produce the integer upload
NOT_ON_THE_GRID = ("secure aggregation: the train handler replied with a float model, not the integer upload "
                   f"'{SECURE_SUM_RECORD}' (use fl_dp_flower.dp_train or secure_sum_update); nothing was uploaded")


def secure_upload_mod(msg: Message, ctxt: Context, call_next: ClientAppCallable) -> Message:
    """Our train reply's integer upload as the legacy FitRes SecAgg+ masks: weight 1, the echoes."""
    if msg.metadata.message_type != MessageType.TRAIN or RECORD_KEY_CONFIGS not in msg.content.config_records \
            or "arrays" not in msg.content.array_records:
        return call_next(msg, ctxt)
    reply = call_next(msg, ctxt)
    if reply.has_error():
        return reply
    if SECURE_SUM_RECORD not in reply.content.array_records:
        return Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=NOT_ON_THE_GRID), reply_to=msg)
    ints = reply.content.array_records[SECURE_SUM_RECORD]
    values = to_flower_values([np.asarray(ints[k].numpy()) for k in ints.keys()])
    metrics = dict(reply.content.metric_records["metrics"]) if "metrics" in reply.content.metric_records else {}
    scalars: dict[str, Any] = secure_echo(metrics)  # a cohort's dp.members as a string: FitRes metrics hold scalars only
    fitres = FitRes(status=Status(code=Code.OK, message="OK"), parameters=ndarrays_to_parameters(values),
                    num_examples=1, metrics=scalars)
    return Message(fitres_to_recorddict(fitres, keep_input=False), reply_to=msg)


def secure_aggregation_mod(msg: Message, ctxt: Context, call_next: ClientAppCallable) -> Message:
    """SecAgg+ train messages through ``secaggplus_mod`` then :func:`secure_upload_mod`; others unchanged."""
    if msg.metadata.message_type == MessageType.TRAIN and RECORD_KEY_CONFIGS in msg.content.config_records:
        return secaggplus_mod(msg, ctxt, lambda m, c: secure_upload_mod(m, c, call_next))
    return call_next(msg, ctxt)
