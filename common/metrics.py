"""What a run records: one record per optimiser step, the environment, and the final weights.

metrics.json (schema version ``SCHEMA_VERSION``) is read by `compare/parity.py` and
`compare/plot.py`. Its keys:

- ``config``: every flag; ``env``: torch version, backend, device, world size, dtypes, data hashes;
- ``records``: per optimiser step ``step`` (1-based), ``loss`` (mean over all ranks and
  micro-batches), ``grad_norm`` (before clipping), ``param_norm``, ``lr``, ``tokens_per_s``,
  ``effective_batch_size`` (micro-batch x accumulation x world size, in samples), ``epoch``,
  ``memory`` (a list, one dict of bytes per rank: sharded steps differ per rank; on a GPU also its
  ``gpu_utilization``, percent or None where NVML cannot be read), ``step_time`` (a list, one dict
  per rank: ``wall_s`` and ``cpu_s``, see ``StepClock``; read by `compare/stragglers.py`, ignored by
  parity), ``device_s`` (what the step cost: the devices of the job x the wall time since the
  previous record), ``per_node`` (each node's samples and tokens per second, ``RunLog.per_node``)
  and, in distributed steps, ``comm`` (bytes rank 0 handed to each kind of collective during
  the step);
- ``cost``: ``RunLog.cost``, the whole run's device-seconds and tokens, every launch of a resumed
  run included (read by `compare/cost.py`);
- ``final``: ``weights`` (safetensors file, relative to the run folder), ``sha256`` of that file,
  ``param_norm``, and ``fingerprints`` (per tensor: shape, sha256 of its bytes, norm).
"""

import hashlib
import json
import os
import platform
import resource
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

SCHEMA_VERSION = 2  # 2: memory is a list, one entry per rank


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def optimizer_state_bytes(optimizer) -> int:
    return tensor_bytes(
        v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)
    )


def memory_stats(
    params, optimizer, device: torch.device, grads=None, masters=None, **counts
) -> dict:
    """Bytes held by this process: what its parameters, gradients (``grads``, by default every
    ``param.grad``), float32 ``masters`` (given: ``master_params``) and optimiser state take, its
    peak resident set size (the whole process: Python, torch, data), and on a GPU what CUDA
    allocated; then ``counts``, a step's own, as given."""
    params = list(params)
    stats = {
        "params": tensor_bytes(params),
        "grads": tensor_bytes(p.grad for p in params) if grads is None else tensor_bytes(grads),
        "optimizer_state": optimizer_state_bytes(optimizer),
        **({} if masters is None else {"master_params": tensor_bytes(masters)}),
        # ru_maxrss is in KiB on Linux and in bytes on macOS
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        * (1 if sys.platform == "darwin" else 1024),
    }
    if device.type == "cuda":
        stats["cuda_allocated"] = torch.cuda.memory_allocated(device)
        stats["cuda_peak"] = torch.cuda.max_memory_allocated(device)
        stats["gpu_utilization"] = gpu_utilization(device)
    return {**stats, **counts}


def gpu_utilization(device: torch.device) -> int | None:
    """The percent of the last sample period (1/6 s to 1 s) in which the GPU ran a kernel, from NVML
    through ``torch.cuda.utilization``; None where it cannot be read (no ``pynvml``, a driver
    without NVML)."""
    try:
        return int(torch.cuda.utilization(device))
    except Exception:  # noqa: BLE001  (ModuleNotFoundError for pynvml, NVML's own errors: all "not available")
        return None


class StepClock:
    """This rank's time for one optimiser step:
    wall-clock seconds and the CPU seconds of this thread.

    Why both. In synchronous data parallelism every rank's *wall* time is the same: a fast rank
    waits for the slowest inside the step's collectives, so the wall time says how slow the job is,
    not which rank makes it slow. The main thread's CPU time (``time.thread_time``) counts only what
    this rank computed: forward, backward and the optimiser run on this thread (one CPU thread per
    rank, torch.set_num_threads(1)), while waiting for a peer sleeps (gloo's own threads do the
    transfers). So a straggler stands out in ``cpu_s`` and not in ``wall_s`` (measured in
    docs/fault_tolerance.md, "Stragglers"). Limits: a rank slow for lack of CPU or for waiting on
    I/O takes wall time, not CPU time, and on a GPU the CPU time is only the launching (CUDA events
    would time the kernels)."""

    def __init__(self):
        self.wall, self.cpu = time.perf_counter(), time.thread_time()

    def stop(self) -> dict:
        return {"wall_s": time.perf_counter() - self.wall, "cpu_s": time.thread_time() - self.cpu}


def environment(
    device: torch.device, world_size: int, backend: str | None, amp: str, corpus
) -> dict:
    """What a run's metrics.json records about where it
    ran and on what data (``corpus``: data.Corpus)."""
    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": str(device) if device.type == "cpu" else torch.cuda.get_device_name(device),
        "backend": backend,
        "world_size": world_size,
        # torchrun's ranks per node (--nproc_per_node); a
        # node's ranks are consecutive: node = rank // this
        "ranks_per_node": int(os.environ.get("LOCAL_WORLD_SIZE", world_size)),
        "param_dtype": "float32",
        "autocast_dtype": {"none": None, "bf16": "bfloat16", "fp16": "float16"}[amp],
        "cpu_threads_per_process": torch.get_num_threads(),
        "data_sha256": corpus.data_sha256,
        "tokenizer_sha256": corpus.tokenizer_sha256,
        "n_samples": len(corpus.blocks),
    }


def fingerprint(tensor: torch.Tensor) -> dict:
    t = tensor.detach().cpu().contiguous()
    return {
        "shape": list(t.shape),
        "sha256": hashlib.sha256(t.view(torch.uint8).numpy().tobytes()).hexdigest(),
        "norm": t.double().norm().item(),
    }


def write_json_atomically(path: Path, data) -> None:
    """Write to a temporary file and rename: a reader never sees half a file."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


def save_final_weights(out_dir: Path, named_tensors: dict) -> dict:
    """Write the full weights as safetensors and return the ``final`` section, with their
    ``param_norm``: exact (training.py), so the bits every step logs from its own slices, shards
    or stages."""
    from training import param_norm

    weights = {name: t.detach().cpu().contiguous() for name, t in named_tensors.items()}
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "model.safetensors"
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    save_file(weights, str(tmp))
    os.replace(tmp, path)
    return {
        "weights": path.name,
        "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
        "fingerprints": {name: fingerprint(t) for name, t in weights.items()},
        "param_norm": param_norm(weights.values()),
    }


class RunLog:
    """Collects the records of a run, prints one compact line per step, writes metrics.json.

    Only the writer (rank 0) prints and writes; the other ranks keep their records in memory.
    """

    def __init__(self, config: dict, env: dict, is_writer: bool, records=None):
        self.config, self.env, self.is_writer = config, env, is_writer
        self.records = list(records or [])
        self.out_dir = Path(config["out"])
        self.started = self.last = time.perf_counter()

    def log(self, record: dict) -> None:
        # Seconds since this process started logging, everything included (the logging's own norms
        # and synchronisations too, which step_time leaves out): what end-to-end throughput is
        # measured from.
        now = time.perf_counter()
        record["since_start_s"] = round(now - self.started, 4)
        # What the step cost: every device of the job was held from the previous record to this one.
        record["device_s"] = round(self.env["world_size"] * (now - self.last), 4)
        self.last = now
        record["per_node"] = self.per_node(record)
        self.records.append(record)
        if self.is_writer and not self.config["quiet"]:
            memory = record["memory"][0]
            rss = f"rss {memory['peak_rss'] / 2**20:.0f} MiB"
            cuda = (
                f" | cuda {memory['cuda_peak'] / 2**20:.0f} MiB peak"
                if "cuda_peak" in memory
                else ""
            )
            print(
                f"step {record['step']:4d}/{self.config['steps']} | loss {record['loss']:.4f} | "
                f"grad norm {record['grad_norm']:.3f} | lr {record['lr']:.2e} | "
                f"{record['tokens_per_s']:,.0f} tok/s | {rss}{cuda}",
                flush=True,
            )

    def per_node(self, record: dict) -> list[dict]:
        """Each node's share of the step's samples (its ranks' share of the job), per second of its
        slowest rank's wall time (``samples_per_s``, ``tokens_per_s``: what the node delivered) and
        of its busiest rank's CPU time (``busy_tokens_per_s``: what it could deliver without
        waiting). In synchronous training every node's wall time is the job's, since fast ranks wait
        in the collectives; a straggling node shows in the busy figure."""
        if "step_time" not in record:
            return []
        times, per_node = (
            record["step_time"],
            self.env.get("ranks_per_node") or len(record["step_time"]),
        )
        # a full node's share of the step
        samples = record["effective_batch_size"] * per_node / len(times)
        nodes = []
        for node in range(0, len(times), per_node):
            ranks = times[node : node + per_node]
            wall, busy = max(t["wall_s"] for t in ranks), max(t["cpu_s"] for t in ranks)
            share = samples * len(ranks) / per_node
            nodes.append(
                {
                    "node": node // per_node,
                    "ranks": len(ranks),
                    "samples_per_s": share / wall,
                    "tokens_per_s": share * self.config["seq_len"] / wall,
                    "busy_tokens_per_s": share * self.config["seq_len"] / busy
                    if busy > 0
                    else None,
                }
            )
        return nodes

    def cost(self) -> dict:
        """Device-seconds and tokens of the records so far (those of earlier launches too: a resumed
        run carries them), and what they buy: tokens per device-hour. A device is a GPU, or a rank
        on the CPU.
        ``steps_timed``: the records that say their cost (one written before ``device_s`` was
        recorded does not)."""
        timed = [r for r in self.records if "device_s" in r]
        device_s = sum(r["device_s"] for r in timed)
        tokens = sum(r["effective_batch_size"] for r in timed) * self.config["seq_len"]
        nodes = {}  # the median over the steps of each node's figures
        for record in self.records:
            for entry in record.get("per_node", []):
                nodes.setdefault(entry["node"], []).append(entry)
        median = lambda values: sorted(values)[len(values) // 2]  # noqa: E731
        return {
            "devices": self.env["world_size"],
            "device": self.env["device"],
            "steps_timed": len(timed),
            "device_s": round(device_s, 4),
            "device_hours": device_s / 3600,
            "tokens": tokens,
            "tokens_per_device_hour": tokens / (device_s / 3600) if device_s > 0 else None,
            "per_node": [
                {
                    "node": node,
                    **{
                        key: median([e[key] for e in entries if e[key] is not None] or [0.0])
                        for key in ("samples_per_s", "tokens_per_s", "busy_tokens_per_s")
                    },
                }
                for node, entries in sorted(nodes.items())
            ],
        }

    def finish(self, final: dict, layout: str | None = None) -> None:
        """Write metrics.json with ``final`` (the exported weights' record) and say the run is done:
        its steps, what it ran on (``layout``; by default the ranks and their backend), its last
        loss and where its weights are."""
        self.write(final)
        if self.is_writer:
            env = self.env
            layout = layout or (
                f" on {env['world_size']} ranks ({env['backend']})" if env["backend"] else ""
            )
            print(
                f"done: {self.config['steps']} steps{layout}, final loss "
                f"{self.records[-1]['loss']:.4f}, "
                f"weights in {self.config['out']}"
            )

    def write(self, final: dict | None = None) -> None:
        if not self.is_writer:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        cost = self.cost()
        write_json_atomically(
            self.out_dir / "metrics.json",
            {
                "schema_version": SCHEMA_VERSION,
                "config": self.config,
                "env": self.env,
                "records": self.records,
                "final": final,
                "cost": cost,
                "wall_time_s": round(time.perf_counter() - self.started, 3),
            },
        )
        if final is not None and not self.config["quiet"]:
            nodes = ", ".join(
                f"node {n['node']} {n['samples_per_s']:,.1f} samples/s "
                f"({n['tokens_per_s']:,.0f} tokens/s, "
                f"{n['busy_tokens_per_s']:,.0f} busy)"
                for n in cost["per_node"]
            )
            print(
                f"cost: {cost['device_s']:,.1f} device-seconds ({cost['devices']} x "
                f"{cost['device']}), "
                f"{cost['tokens']:,} tokens, "
                f"{cost['tokens_per_device_hour'] or 0:,.0f} tokens per device-hour; "
                f"median per node: {nodes}"
            )
