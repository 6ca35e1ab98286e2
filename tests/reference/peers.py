"""Peer values for the library's tests: the published trainers' own loss code, on the test's inputs.

Run by `tests/common/mod.rs::peer` with `TOPR_REFERENCE_PYTHON` (see scripts/env.sh). Reads one JSON
object from stdin, `{"calls": [{"fn": NAME, "args": {...}}, ...]}`, and prints one JSON object,
`{"results": [...]}`, one result per call (a dict of lists and numbers).

Where a peer ships its losses as plain functions (verl's `core_algos` and `rollout_corr_helper`),
the `peer_verl*.py` modules call that code itself: verl 0.9.1 is installed without its dependencies,
and the two modules its package `__init__` imports but the loss functions never use (ray,
tensordict) are replaced by empty stand-ins below. Where a peer writes its losses inline in a
trainer method (TRL), the `peer_trl*.py` modules restate those lines as plain functions, naming the
file and version they follow.

Every `peer_*.py` module of this folder registers its functions with `@peer("name")`. Tensors go in
as nested lists and are built in float64; a function returns a dict whose tensors become lists.
"""
import glob
import importlib
import importlib.abc
import importlib.machinery
import json
import os
import sys
import types

import torch

REGISTRY = {}


def peer(name):
    """Registers a reference function under `name`."""

    def wrap(f):
        REGISTRY[name] = f
        return f

    return wrap


class _Empty(types.ModuleType):
    """A module (and anything reached through it) that is never used, only imported."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Empty(f"{self.__name__}.{name}")

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]  # used as a decorator
        return _Empty("call")

    def __or__(self, other):
        return self

    def __ror__(self, other):
        return self

    def __getitem__(self, key):
        return self

    def __mro_entries__(self, bases):
        return (object,)


class _EmptyFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    ROOTS = {"ray", "tensordict"}

    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in self.ROOTS:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        m = _Empty(spec.name)
        m.__path__ = []
        return m

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _EmptyFinder())


def tensor(v, dtype=torch.float64):
    """A nested list as a tensor (float64 unless told)."""
    return torch.tensor(v, dtype=dtype)


def leaf(v):
    """A nested list as a float64 leaf that records its gradient."""
    return torch.tensor(v, dtype=torch.float64, requires_grad=True)


def out(**values):
    """Tensors and numbers as JSON-ready values."""
    res = {}
    for k, v in values.items():
        if isinstance(v, torch.Tensor):
            v = v.detach()
            res[k] = v.tolist() if v.dim() > 0 else v.item()
        else:
            res[k] = v
    return res


def verl_actor_config(**fields):
    """verl's own `ActorConfig` with the fields its policy-loss functions read (clip ratios, …),
    for one process (`global_batch_info` empty: the micro-batch's own counts). The batch-size
    fields are required by its checks and unused by the losses."""
    from verl.workers.config import ActorConfig

    base = dict(strategy="fsdp", rollout_n=1, ppo_mini_batch_size=1, ppo_micro_batch_size_per_gpu=1)
    base.update(fields)
    return ActorConfig(**base)


def _load():
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, here)
    for path in sorted(glob.glob(os.path.join(here, "peer_*.py"))):
        importlib.import_module(os.path.basename(path)[:-3])


def main():
    _load()
    request = json.load(sys.stdin)
    results = []
    for call in request["calls"]:
        f = REGISTRY.get(call["fn"])
        if f is None:
            raise SystemExit(f"peers.py: no reference named {call['fn']!r} (have {sorted(REGISTRY)})")
        results.append(f(**call.get("args", {})))
    json.dump({"results": results}, sys.stdout)


if __name__ == "__main__":
    sys.modules["peers"] = sys.modules["__main__"]
    main()
