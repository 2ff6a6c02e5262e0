"""ClientApp: fl-dp-flower's dp_train runs the clipped local steps, the noise and the reply;
secure_aggregation_mod carries the upload through Flower's SecAgg+ when the server asks for it
(every other message passes unchanged)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from flwr.app import Context
from flwr.clientapp import ClientApp

from fl_dp_flower import dp_train, secure_aggregation_mod
from digits_dp.task import DigitsNet, load_partition


def my_data(context: Context) -> tuple[torch.Tensor, torch.Tensor]:
    return load_partition(int(context.node_config["partition-id"]), int(context.node_config["num-partitions"]))


app = ClientApp(mods=[secure_aggregation_mod])
app.train()(dp_train(model_fn=DigitsNet, data_fn=my_data, loss_fn=F.cross_entropy))
