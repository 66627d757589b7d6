"""Day 18: beyond one device. Tensor and pipeline parallelism on torch.distributed.

When a model's weights (or its KV cache) do not fit one device, or one device's memory bandwidth
is too little for the latency wanted, the model is split across several devices ("ranks") that
exchange activations. This package does it with torch.distributed: the ranks are processes, gloo
carries their messages on a CPU; the code is written for NCCL on GPUs too (one CUDA device per
rank), but it has not yet run on a machine with several GPUs.

The package, one room per concern (each imports only rooms above it in this list):

    ranks           run_ranks: fn(rank, world_size, ...) in local processes joined by a process
                    group (gloo; NCCL on GPUs); clear errors, never a hang. init_rank, free_port
    sharding        plan_heads, vocab_range, shard_state_dict: which heads / rows / columns
                    each rank keeps, and the degrees refused
    comm            CommStats, COMM: this process's collectives, timed and counted
    layers          ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                    VocabParallelHead (Megatron-LM's layout), distributed_argmax
    source          load_source: the full model a rank loads, from a picklable description;
                    source_config: its config, for checks before any rank starts
    model           TensorParallelGPT (a TinyGPT whose layers are the above: generate(), the
                    KV cache and the day-17 engine run on it unchanged), shard_model, tp_check
    pipeline        stage_layers, bubble_fraction, pipeline_run: stages of whole layers,
                    send/recv, micro-batches, the measured idle share against GPipe's
    cost            LINKS, ring_allreduce_seconds, allreduce_bytes, activation_dtype,
                    tp_decode_estimate, measure_allreduce, fit_link, measure_tp_decode: what
                    tensor parallelism sends and what that costs on a link, predicted and
                    measured on gloo;
                    alltoall_bytes, alltoall_seconds, ep_comm_estimate, measure_alltoall,
                    fit_alltoall_link: the same for expert parallelism's all-to-alls
    experts         ExpertParallelMoE, expert_parallel_model, expert_range, token_range,
                    dispatch_rows, EPStats, EP_COMM, ep_check, measure_ep_decode: day 20's
                    expert parallelism, E / p experts per rank, token rows sent to them and
                    back with all-to-alls
    disaggregation  mixed_workload, compare_disaggregation: a prefill rank shipping paged KV
                    blocks to a decode rank, against the colocated engine with and without
                    chunked prefill
    serving         start_tensor_parallel, follow_leader: `serve --tensor-parallel-size N`;
                    rank 0 serves and broadcasts every step's arrivals, aborts and seeds, the
                    others follow

Every name is re-exported here: `from tinygpt import parallel; parallel.run_ranks(...)`.
"""

from tinygpt.parallel.comm import COMM, CommStats
from tinygpt.parallel.cost import (
    LINKS,
    SMOLLM2_135M,
    EPCommEstimate,
    Link,
    TPDecodeMeasurement,
    TPEstimate,
    activation_dtype,
    allgather_seconds,
    allreduce_bytes,
    alltoall_bytes,
    alltoall_seconds,
    ep_comm_estimate,
    fit_alltoall_link,
    fit_link,
    measure_allreduce,
    measure_alltoall,
    measure_tp_decode,
    ring_allreduce_seconds,
    tp_decode_estimate,
)
from tinygpt.parallel.disaggregation import (
    DisaggregationReport,
    Workload,
    compare_disaggregation,
    mixed_workload,
)
from tinygpt.parallel.experts import (
    EP_COMM,
    EPDecodeMeasurement,
    EPStats,
    ExpertParallelMoE,
    dispatch_rows,
    ep_check,
    expert_parallel_model,
    expert_range,
    measure_ep_decode,
    token_range,
)
from tinygpt.parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabParallelHead,
    distributed_argmax,
)
from tinygpt.parallel.model import TensorParallelGPT, shard_model, tp_check
from tinygpt.parallel.pipeline import PipelineRun, bubble_fraction, pipeline_run, stage_layers
from tinygpt.parallel.ranks import default_backend, free_port, init_rank, run_ranks
from tinygpt.parallel.serving import (
    SERVE_TIMEOUT_S,
    STEP_TIMEOUT_S,
    follow_leader,
    start_tensor_parallel,
)
from tinygpt.parallel.serving import _mirror_rank as _mirror_rank  # the tests run it on ranks
from tinygpt.parallel.sharding import HeadPlan, plan_heads, shard_state_dict, vocab_range
from tinygpt.parallel.source import load_source, source_config

__all__ = [
    "free_port", "default_backend", "init_rank", "run_ranks",
    "HeadPlan", "plan_heads", "vocab_range", "shard_state_dict",
    "CommStats", "COMM",
    "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "VocabParallelHead",
    "distributed_argmax",
    "load_source", "source_config",
    "TensorParallelGPT", "shard_model", "tp_check",
    "stage_layers", "bubble_fraction", "PipelineRun", "pipeline_run",
    "SMOLLM2_135M", "Link", "LINKS", "ring_allreduce_seconds", "allgather_seconds",
    "allreduce_bytes", "activation_dtype", "TPEstimate", "tp_decode_estimate",
    "measure_allreduce", "fit_link",
    "TPDecodeMeasurement", "measure_tp_decode",
    "alltoall_bytes", "alltoall_seconds", "EPCommEstimate", "ep_comm_estimate",
    "measure_alltoall", "fit_alltoall_link",
    "expert_range", "token_range", "dispatch_rows", "EPStats", "EP_COMM", "ExpertParallelMoE",
    "expert_parallel_model", "ep_check", "EPDecodeMeasurement", "measure_ep_decode",
    "Workload", "mixed_workload", "DisaggregationReport", "compare_disaggregation",
    "SERVE_TIMEOUT_S", "STEP_TIMEOUT_S", "start_tensor_parallel", "follow_leader",
]
