"""Analytical performance model: when does compression pay? (pure math + calibration data).

    from megatron_zpp.perfmodel import load_cluster, load_workload, predict
    cluster = load_cluster("configs/clusters/v100-384-1ib.yaml")
    workload = load_workload("configs/workloads/gpt-18b-384gpu.yaml")
    p = predict(cluster, workload, "zeropp")       # or "megatron", "fair", "qwz", "hpz", "qgz", a Policy
    p.step_time_s, p.tokens_per_s, p.bytes["dp.grad"].inter, p.inter_bytes_per_node

Imports the policy and codec layers (for presets and exact wire bytes), never ``megatron_zpp.comm``,
Megatron or a process group. Formulas, assumptions and what is not modelled: ``README.md`` here.
"""

from megatron_zpp.perfmodel.collectives import Cost, Group
from megatron_zpp.perfmodel.model import (BUILTIN_POLICIES, DEFAULT_POLICIES, TAGS, ModelledPolicy, Prediction,
                                          TagBytes, full_precision_weight_gather_s, iteration_flops, predict, resolve,
                                          total_params)
from megatron_zpp.perfmodel.specs import (ClusterSpec, CodecThroughput, LayoutSpec, MeasuredIteration, MeasuredLayer,
                                          ModelSpec,
                                          WorkloadSpec, from_dict, load_cluster, load_workload)

__all__ = ["BUILTIN_POLICIES", "DEFAULT_POLICIES", "TAGS", "ClusterSpec", "CodecThroughput", "Cost", "Group",
           "LayoutSpec", "MeasuredIteration", "MeasuredLayer", "ModelSpec", "ModelledPolicy", "Prediction", "TagBytes", "WorkloadSpec",
           "from_dict", "full_precision_weight_gather_s", "iteration_flops", "load_cluster", "load_workload", "predict", "resolve", "total_params"]
