"""Collectives on the planner's links: the seconds of a ring collective or an all-to-all over a group of ranks,
NVLink inside a node and the NICs across nodes (see :mod:`.step_time`, which times every layout's communication
with them, and :mod:`.context_cost`)."""

from __future__ import annotations

import math

from .device_spec import DeviceSpec


def group_bandwidth(size: int, stride: int, device: DeviceSpec) -> float:
    """Bytes/s a ring collective over ``size`` ranks ``stride`` apart reaches: NVLink inside one node; across
    nodes, the NICs of the group's ranks on each node together (one NIC per GPU), at most NVLink's."""
    per_node = max(device.devices_per_node, 1)
    if size * stride <= per_node:
        bandwidth = device.intra_node_bandwidth
    else:
        on_one_node = max(1, min(size, per_node // stride))
        bandwidth = min(device.intra_node_bandwidth, device.inter_node_bandwidth * on_one_node)
    return bandwidth * device.bandwidth_efficiency


def ring_seconds(nbytes: float, size: int, stride: int, device: DeviceSpec, all_reduce: bool = True) -> float:
    """A ring all-reduce (or, with ``all_reduce=False``, an all-gather or reduce-scatter) of ``nbytes`` over
    ``size`` ranks ``stride`` apart."""
    if size <= 1 or nbytes <= 0:
        return 0.0
    volume = (2.0 if all_reduce else 1.0) * (size - 1) / size * nbytes
    steps = 2 * math.ceil(math.log2(size))
    return volume / group_bandwidth(size, stride, device) + steps * device.link_latency_s


def all_to_all_seconds(nbytes: float, size: int, stride: int, device: DeviceSpec) -> float:
    """An all-to-all in which each of ``size`` ranks ``stride`` apart sends ``nbytes`` spread evenly over the
    group: peers on the same node over NVLink, the others over the rank's NIC, both at once."""
    if size <= 1 or nbytes <= 0:
        return 0.0
    per_node = max(device.devices_per_node, 1)
    on_node = max(1, min(size, per_node // stride))
    near = nbytes * (on_node - 1) / size / (device.intra_node_bandwidth * device.bandwidth_efficiency)
    far = nbytes * (size - on_node) / size / (device.inter_node_bandwidth * device.bandwidth_efficiency)
    return max(near, far) + device.link_latency_s
