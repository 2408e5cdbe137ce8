"""``convert_syncbn_model`` (:mod:`mpnb.core.parallel.convert`): a deep copy of a model with
every batch norm a SyncBatchNorm, its weights, buffers, mode and settings kept."""

from __future__ import annotations

import pytest
import torch

from mpnb.parallel import SyncBatchNorm, convert_syncbn_model


def test_convert_keeps_weights_and_buffers_and_leaves_the_original():
    net = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 1),
        torch.nn.BatchNorm2d(4),
        torch.nn.Sequential(torch.nn.BatchNorm1d(4, affine=False)),
    )
    net[1].running_mean.fill_(0.5)
    net[1].weight.data.fill_(2.0)
    net.eval()
    conv = convert_syncbn_model(net, channel_last=False)
    assert isinstance(net[1], torch.nn.BatchNorm2d)  # original untouched
    assert isinstance(conv[1], SyncBatchNorm) and isinstance(conv[2][0], SyncBatchNorm)
    assert not conv[1].training
    sd, sd2 = net.state_dict(), conv.state_dict()
    assert sd.keys() == sd2.keys()
    for k in sd:
        torch.testing.assert_close(sd[k], sd2[k])
    assert conv[1].weight is not net[1].weight


@pytest.mark.parametrize(
    "bn", [torch.nn.BatchNorm1d(5), torch.nn.BatchNorm3d(5), torch.nn.SyncBatchNorm(5)]
)
def test_every_kind_of_batch_norm_is_converted_with_its_settings(bn):
    bn.eps, bn.momentum = 1e-3, None
    conv = convert_syncbn_model(torch.nn.Sequential(bn))[0]
    assert type(conv) is SyncBatchNorm
    assert (conv.num_features, conv.eps, conv.momentum) == (5, 1e-3, None)
    assert conv.affine and conv.track_running_stats


def test_without_affine_or_running_stats_the_copy_has_none_either():
    net = torch.nn.Sequential(torch.nn.BatchNorm1d(3, affine=False, track_running_stats=False))
    conv = convert_syncbn_model(net)[0]
    assert conv.weight is None and conv.bias is None and conv.running_mean is None
    x = torch.randn(6, 3)
    torch.testing.assert_close(conv(x), net(x))


def test_channel_last_and_the_group_reach_the_new_layers():
    group = object()  # stored as given; used only when the layer runs under a process group
    conv = convert_syncbn_model(torch.nn.BatchNorm2d(4), process_group=group, channel_last=True)
    assert conv.channel_last and conv.process_group is group


def test_a_model_without_batch_norms_is_copied_unchanged():
    net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.LayerNorm(2))
    conv = convert_syncbn_model(net)
    assert conv is not net and [type(m) for m in conv] == [torch.nn.Linear, torch.nn.LayerNorm]
    assert torch.equal(conv[0].weight, net[0].weight) and conv[0].weight is not net[0].weight


def test_a_syncbatchnorm_already_there_is_kept_as_it_is():
    ours = SyncBatchNorm(3)
    ours.running_mean.fill_(2.0)
    conv = convert_syncbn_model(torch.nn.Sequential(ours))[0]
    assert type(conv) is SyncBatchNorm and torch.equal(conv.running_mean, ours.running_mean)
