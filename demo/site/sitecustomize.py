"""Per-rank measurement, injected with ``PYTHONPATH=demo/site`` (the measured script is unchanged).

Active only when ``PATCHLOAD_MEASURE_DIR`` is set. Then, in every process launched by torchrun:

* ``HF_HUB_USER_AGENT_ORIGIN=rank-$RANK`` (before ``huggingface_hub`` is imported), so the
  loopback hub's request log attributes each request to a rank;
* ``safetensors.safe_open`` is replaced (before ``transformers`` binds it) by a counting proxy:
  files opened, and bytes of every tensor materialised through ``get_tensor`` or a
  ``get_slice(...)[...]``: the checkpoint bytes this rank read;
* ``PreTrainedModel.from_pretrained`` is wrapped (wrapt) to record when the outermost call
  entered and returned, in ``time.time()`` seconds;
* transformers 5's weight-loading step (``convert_and_load_state_dict_in_model``, as
  ``modeling_utils`` calls it) is wrapped to record when this rank first entered it
  (``weights_started_at``): the node's memory then is what the job held before any weight;
* ``torch.distributed.init_process_group`` is wrapped to record when it returned
  (``process_group_ready_at``): by then every rank has imported its libraries and joined;
* ``DistributedDataParallel.__init__`` is wrapped to record when it returned (``ddp_ready_at``:
  it broadcasts rank 0's parameters into every rank's, which writes them), and an optimizer
  step post-hook records when each step returned (``steps_done_at``);
* at exit, ``$PATCHLOAD_MEASURE_DIR/rank-$RANK.json`` holds all of the above.

If the measured process also chains to another ``sitecustomize`` on the path, it is not run.
"""

import atexit
import json
import os
import time

_DIR = os.environ.get("PATCHLOAD_MEASURE_DIR")


def _install() -> None:
    rank = os.environ.get("RANK", "0")
    os.environ.setdefault("HF_HUB_USER_AGENT_ORIGIN", f"rank-{rank}")
    stats = {"rank": int(rank), "pid": os.getpid(), "safetensors_files_opened": 0,
             "safetensors_opened": [], "checkpoint_tensor_bytes": 0, "tensors_read": 0,
             "from_pretrained": []}

    import safetensors

    real_safe_open = safetensors.safe_open

    def _count(tensor):
        try:
            stats["checkpoint_tensor_bytes"] += tensor.numel() * tensor.element_size()
            stats["tensors_read"] += 1
        except AttributeError:  # a non-torch framework: count nothing
            pass
        return tensor

    class _Slice:
        def __init__(self, real):
            self._real = real

        def __getitem__(self, index):
            return _count(self._real[index])

        def __getattr__(self, name):
            return getattr(self._real, name)

    class safe_open:  # noqa: N801 - same name as the class it stands in for
        def __init__(self, filename, *args, **kwargs):
            self._real = real_safe_open(filename, *args, **kwargs)
            stats["safetensors_files_opened"] += 1
            stats["safetensors_opened"].append(os.path.basename(str(filename)))

        def __enter__(self):
            self._real.__enter__()
            return self

        def __exit__(self, *exc):
            return self._real.__exit__(*exc)

        def get_tensor(self, name):
            return _count(self._real.get_tensor(name))

        def get_slice(self, name):
            return _Slice(self._real.get_slice(name))

        def __getattr__(self, name):
            return getattr(self._real, name)

    safetensors.safe_open = safe_open

    import wrapt

    depth = [0]

    def _timed(wrapped, instance, args, kwargs):
        depth[0] += 1
        entered = time.time()
        try:
            return wrapped(*args, **kwargs)
        finally:
            depth[0] -= 1
            if depth[0] == 0:
                owner = instance if isinstance(instance, type) else type(instance)
                stats["from_pretrained"].append(
                    {"class": owner.__name__, "entered_at": entered, "returned_at": time.time()})
                _write()

    def _weights(wrapped, instance, args, kwargs):
        stats.setdefault("weights_started_at", time.time())
        return wrapped(*args, **kwargs)

    def _hook(module):
        wrapt.wrap_function_wrapper(module, "PreTrainedModel.from_pretrained", _timed)
        if hasattr(module, "convert_and_load_state_dict_in_model"):  # transformers 5
            wrapt.wrap_function_wrapper(module, "convert_and_load_state_dict_in_model", _weights)

    wrapt.register_post_import_hook(_hook, "transformers.modeling_utils")

    def _record_return(module_name, name, key):
        """When ``module_name``'s ``name`` last returned, in ``stats[key]``."""
        def timed(wrapped, instance, args, kwargs):
            result = wrapped(*args, **kwargs)
            stats[key] = time.time()
            return result

        wrapt.register_post_import_hook(
            lambda module: wrapt.wrap_function_wrapper(module, name, timed), module_name)

    _record_return("torch.distributed", "init_process_group", "process_group_ready_at")
    _record_return("torch.nn.parallel.distributed", "DistributedDataParallel.__init__",
                   "ddp_ready_at")

    def _step_done(optimizer, args, kwargs):
        stats.setdefault("steps_done_at", []).append(time.time())

    def _optim_hook(module):
        module.register_optimizer_step_post_hook(_step_done)

    wrapt.register_post_import_hook(_optim_hook, "torch.optim.optimizer")

    def _write() -> None:
        path = os.path.join(_DIR, f"rank-{rank}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(stats, f)
        os.replace(path + ".tmp", path)

    atexit.register(_write)


if _DIR and os.environ.get("RANK") is not None:
    _install()
