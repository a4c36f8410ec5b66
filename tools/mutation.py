"""Mutation testing of fsdp_wrap's core modules: do the tests catch small bugs?

A *mutant* is the library with one small change a programmer could make by
mistake (``<`` for ``<=``, ``+`` for ``-``, ``and`` for ``or``, a ``not``
dropped, a number off by one, ``True`` for ``False``).  Each module listed in
:data:`TARGETS` is paired with the fast test selection that should catch its
bugs; a mutant is *killed* when a test of that selection fails, *survives*
when it passes, and *times out* when it runs past its time limit or a test
pool reports ranks that made no progress (a hang the mutant caused, or only a
loaded machine: ``sweep`` runs such a mutant once more with twice the time
and reports one that times out again as ``timeout``, apart from the killed
ones, and ``record`` leaves it out).  Survivors are
triaged in docs/testing.rst ("Mutation testing"): an equivalent mutant (the
change cannot alter behaviour, and why) or a missing test (then written).

Each run works on a copy of the checkout (``fsdp_wrap/``, ``tests/``,
``pyproject.toml``) in a temporary folder, never on the checkout itself, with
``PYTHONDONTWRITEBYTECODE`` so that no stale bytecode of a mutant survives it.

Usage::

    # a seeded sample of N mutants per module, its kill rate per module
    nice -n 19 python tools/mutation.py sweep --seed 1 --per-module 12 \\
        --modules fsdp_wrap/comm/quant/codec.py --json out.json

    # CI: a time-boxed, seeded sample of the mutants recorded as killed in
    # tools/mutation_killed.json; exit 1 if one of them survives now
    python tools/mutation.py check --seed 0 --count 6 --budget 240

    # how long each module's selection takes unmutated
    nice -n 19 python tools/mutation.py baseline fsdp_wrap/comm/bucket.py

    # list a module's mutants
    python tools/mutation.py list fsdp_wrap/comm/quant/codec.py

Mutant ids are ``path:line:column:operator`` with the source line's text
recorded beside them; ``check`` finds a recorded mutant again by that text
when lines moved, and reports it as stale (not a failure) when the code it
mutated is gone.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KILLED_FILE = os.path.join(ROOT, "tools", "mutation_killed.json")

# module -> the fast test selection that should catch its bugs (pytest arguments)
TARGETS: dict[str, list[str]] = {
    "fsdp_wrap/comm/quant/codec.py": ["tests/test_quant_codec.py"],
    "fsdp_wrap/comm/quant/config.py": ["tests/test_quant_codec.py"],
    "fsdp_wrap/comm/quant/wire.py": [
        "tests/test_quantized_collectives.py", "-k", "docs_say or no_effect or one_replica or refusals"],
    "fsdp_wrap/comm/quant/topology.py": [
        "tests/test_quantized_collectives.py", "-k", "docs_say or refusals"],
    # (the profiler's test: the labelled branches, taken only while a profiler records)
    "fsdp_wrap/comm/bucket.py": ["tests/test_buckets.py", "tests/test_profiler_labels.py",
                                 "-k", "not bit_identical"],
    "fsdp_wrap/comm/gather_batch.py": ["tests/test_gather_batch.py",
                                       "tests/test_profiler_labels.py", "-k", "not bit_identical"],
    "fsdp_wrap/comm/collectives.py": ["tests/test_gloo_collectives.py"],
    "fsdp_wrap/comm/schedule.py": ["tests/test_schedule.py", "-k", "rule or unbatched"],
    "fsdp_wrap/checkpoint/_atomic.py": ["tests/test_ckpt_tool.py", "tests/test_corruption.py"],
    "fsdp_wrap/checkpoint/_safetensors.py": ["tests/test_ckpt_tool.py",
                                             "tests/test_corruption.py"],
    "fsdp_wrap/checkpoint/full.py": [
        "tests/test_full_checkpoint.py",  # (and trainable_only=True, without PEFT)
        "tests/test_adapter_checkpoint.py::test_plain_layout_rank_without_trainable_elements_and_refusals",
        "-k", "not sigkill and not transformers"],
    "fsdp_wrap/state_dict/optim.py": ["tests/test_optim_state_dict.py"],
    "fsdp_wrap/state_dict/model.py": ["tests/test_state_dict.py"],
    "fsdp_wrap/handle/grads.py": [
        "tests/test_parity.py", "tests/test_summon_full_params.py", "tests/test_mixed_precision.py",
        "tests/test_accumulation.py", "tests/test_robustness.py", "-k",
        "deep-2 or accumulation-2 or summon_options or keep_low_precision or equals_emulation "
        "or (reentrant_checkpoint_over_part_of_a_unit and not hybrid) or assigned_before"],
    "fsdp_wrap/handle/flat_param.py": [
        "tests/test_flat_param.py", "tests/test_parity.py", "tests/test_mixed_precision.py",
        "tests/test_memory_schedule.py", "tests/test_profiler_labels.py",
        "tests/test_summon_full_params.py", "tests/test_gather_batch.py",
        "tests/test_quantized_collectives.py", "tests/test_env_options.py", "-k",
        "real_handles or validation or deep-2 or keep_low_precision or streams_one_unit or "
        "a_trace_names or summon_options or did_not_run or emulation_2_ranks or "
        "full_precision_in_eval or load_shard"],
    "fsdp_wrap/runtime/guards.py": ["tests/test_silent_setups.py"],
    "fsdp_wrap/runtime/hooks.py": [
        "tests/test_parity.py", "tests/test_gather_batch.py", "tests/test_silent_setups.py",
        "tests/test_orig_params_writeback.py", "-k",
        "deep-2 or frozen_mixed-2 or accumulation-2 or forward_gathers_the_next or each_member "
        "or replicas_differ_no_shard or writeback_refusals"],  # (the root's pre-forward checks;
    # parameters replaced between forward and backward)
    "fsdp_wrap/runtime/accumulation.py": ["tests/test_accumulation.py"],
    "fsdp_wrap/runtime/agreement.py": ["tests/test_rank_settings.py"],
}

_SWAP_CMP: dict[type, type] = {
    ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt,
    ast.Eq: ast.NotEq, ast.NotEq: ast.Eq, ast.Is: ast.IsNot, ast.IsNot: ast.Is,
    ast.In: ast.NotIn, ast.NotIn: ast.In,
}
_SWAP_BIN: dict[type, type] = {
    ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.FloorDiv, ast.Div: ast.Mult,
    ast.FloorDiv: ast.Mult, ast.Mod: ast.FloorDiv, ast.LShift: ast.RShift,
    ast.RShift: ast.LShift, ast.BitAnd: ast.BitOr, ast.BitOr: ast.BitAnd,
}


@dataclass(frozen=True)
class Mutant:
    path: str  # relative to the checkout
    line: int
    col: int
    op: str  # e.g. "Lt->LtE", "And->Or", "not-dropped", "1->2", "True->False"
    text: str  # the source line, stripped (to find it again when lines move)
    index: int  # which of the candidates at (line, col, op), in walk order

    @property
    def id(self) -> str:
        return f"{self.path}:{self.line}:{self.col}:{self.op}"


def _skipped_nodes(tree: ast.AST) -> set[int]:
    """Nodes whose mutation says nothing about behaviour: docstrings, messages
    (f-strings, the arguments of ``raise`` and ``warnings.warn``), annotations,
    ``__all__``."""
    skip: set[int] = set()

    def drop(node: ast.AST | None) -> None:
        if node is not None:
            skip.update(id(n) for n in ast.walk(node))

    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and \
                isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            drop(body[0])
        if isinstance(node, (ast.JoinedStr, ast.Raise)):
            drop(node)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                node.func.attr == "warn":
            drop(node)
        if isinstance(node, (ast.arg, ast.AnnAssign)):
            drop(node.annotation)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            drop(node.returns)
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            drop(node)
    return skip


def _candidates(tree: ast.AST) -> Iterator[tuple[ast.AST, str]]:
    """(node, operator) for every mutation of ``tree``, in a stable order."""
    skip = _skipped_nodes(tree)
    for node in ast.walk(tree):
        if id(node) in skip or not hasattr(node, "lineno"):
            continue
        if isinstance(node, ast.Compare):
            for op in node.ops:
                if type(op) in _SWAP_CMP:
                    yield node, f"{type(op).__name__}->{_SWAP_CMP[type(op)].__name__}"
        elif isinstance(node, (ast.BinOp, ast.AugAssign)) and type(node.op) in _SWAP_BIN:
            yield node, f"{type(node.op).__name__}->{_SWAP_BIN[type(node.op)].__name__}"
        elif isinstance(node, ast.BoolOp):
            yield node, "And->Or" if isinstance(node.op, ast.And) else "Or->And"
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            yield node, "not-dropped"
        elif isinstance(node, ast.Constant) and type(node.value) is bool:
            yield node, f"{node.value}->{not node.value}"
        elif isinstance(node, ast.Constant) and type(node.value) is int:
            yield node, f"{node.value}->{node.value + 1}"


def mutants_of(path: str) -> list[Mutant]:
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        source = f.read()
    lines = source.splitlines()
    out: list[Mutant] = []
    seen: dict[tuple[int, int, str], int] = {}
    for node, op in _candidates(ast.parse(source)):
        line, col = node.lineno, node.col_offset  # type: ignore[attr-defined]
        key = (line, col, op)
        seen[key] = seen.get(key, -1) + 1
        out.append(Mutant(path, line, col, op, lines[line - 1].strip(), seen[key]))
    return out


def mutated_source(source: str, m: Mutant) -> str:
    """``source`` with mutant ``m`` applied (the module unparsed: formatting and
    comments change, behaviour only where the mutant says)."""
    tree = ast.parse(source)
    count = -1
    for node, op in _candidates(tree):
        if (node.lineno, node.col_offset, op) != (m.line, m.col, m.op):  # type: ignore[attr-defined]
            continue
        count += 1
        if count != m.index:
            continue
        _apply(node, op)
        return ast.unparse(tree) + "\n"
    raise LookupError(f"mutant {m.id} not found")


def _apply(node: ast.AST, op: str) -> None:
    if isinstance(node, ast.Compare):
        old = op.split("->")[0]
        i = next(i for i, o in enumerate(node.ops) if type(o).__name__ == old)
        node.ops[i] = _SWAP_CMP[type(node.ops[i])]()
    elif isinstance(node, (ast.BinOp, ast.AugAssign)):
        node.op = _SWAP_BIN[type(node.op)]()
    elif isinstance(node, ast.BoolOp):
        node.op = ast.Or() if isinstance(node.op, ast.And) else ast.And()
    elif isinstance(node, ast.UnaryOp):  # not x -> (x): a no-op unary plus keeps the tree
        node.op = ast.UAdd()
        node.operand = ast.Call(ast.Name("bool", ast.Load()), [node.operand], [])
    elif isinstance(node, ast.Constant) and isinstance(node.value, int):
        node.value = (not node.value) if type(node.value) is bool else node.value + 1


def relocate(m: Mutant) -> Mutant | None:
    """``m`` in today's source: the same line text and operator (the nearest such
    line if lines moved); ``None`` when the code it mutated is gone."""
    if not os.path.exists(os.path.join(ROOT, m.path)):
        return None
    now = [c for c in mutants_of(m.path) if c.op == m.op and c.text == m.text]
    if not now:
        return None
    same = [c for c in now if c.index == m.index] or now
    return min(same, key=lambda c: abs(c.line - m.line))


# ------------------------------------------------------------------ running


class Sandbox:
    """A copy of the checkout to mutate (fsdp_wrap/, tests/, pyproject.toml)."""

    def __init__(self) -> None:
        self.root = tempfile.mkdtemp(prefix="fsdp-wrap-mutants-")
        ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
        for name in ("fsdp_wrap", "tests"):
            shutil.copytree(os.path.join(ROOT, name), os.path.join(self.root, name),
                            ignore=ignore)
        shutil.copy(os.path.join(ROOT, "pyproject.toml"), self.root)

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    def run(self, m: Mutant | None, timeout: float, pool_timeout: float = 30.0,
            ) -> tuple[str, float, str]:
        """``("killed" | "survived" | "timeout", seconds, output tail)``;
        ``m=None`` runs the selection of nothing mutated (the baseline)."""
        path = os.path.join(self.root, m.path) if m is not None else None
        original = None
        if m is not None and path is not None:
            with open(path, encoding="utf-8") as f:
                original = f.read()
            with open(path, "w", encoding="utf-8") as f:
                f.write(mutated_source(original, m))
        target = m.path if m is not None else ""
        env = dict(os.environ, PYTHONPATH=self.root, PYTHONDONTWRITEBYTECODE="1",
                   FSDP_WRAP_TEST_TIMEOUT=str(pool_timeout), PYTHONWARNINGS="ignore")
        env.pop("FSDP_WRAP_REQUIRE", None)
        cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
               *TARGETS[target or _baseline_target]]  # (pyproject's addopts: not slow)
        t0 = time.monotonic()
        try:
            proc = subprocess.run(cmd, cwd=self.root, env=env, capture_output=True, text=True,
                                  timeout=timeout, start_new_session=True)
            status = "survived" if proc.returncode == 0 else "killed"
            tail = (proc.stdout + proc.stderr)[-600:]
            if proc.returncode not in (0, 1):  # collection error, usage error, internal
                status = "killed" if m is not None else "error"
            elif status == "killed" and _POOL_HANG.search(proc.stdout + proc.stderr):
                # a pool's ranks made no progress: a hang the mutant caused, or a
                # loaded machine; either way not a failed assertion
                status = "timeout"
        except subprocess.TimeoutExpired as e:
            status, tail = "timeout", str(e.stdout or "")[-300:]
        finally:
            if original is not None and path is not None:
                with open(path, "w", encoding="utf-8") as f:
                    f.write(original)
        return status, time.monotonic() - t0, tail


_baseline_target = ""
# what a test pool says when its ranks made no progress, or it could not start
# in time (tests/_dist.py); not when ranks stopped waiting after another failed
# (and not the source lines of a traceback that prints how it says it)
_POOL_HANG = re.compile(r"within [0-9.]+s \(no progress for timeout=[0-9.]+s\)"
                        r"|start-up timed out after [0-9]+s")


def sweep(modules: list[str], per_module: int, seed: int, limit_factor: float) -> dict[str, object]:
    """A seeded sample of ``per_module`` mutants of each module, each against
    its module's selection; results per module."""
    global _baseline_target
    rng = random.Random(seed)
    box = Sandbox()
    results: dict[str, object] = {"seed": seed, "per_module": per_module, "modules": {}}
    try:
        for module in modules:
            _baseline_target = module
            status, base, tail = box.run(None, timeout=1800)
            if status != "survived":
                raise SystemExit(f"{module}: its selection fails unmutated:\n{tail}")
            print(f"-- {module}: baseline {base:.0f} s", flush=True)
            pool = mutants_of(module)
            sample = rng.sample(pool, min(per_module, len(pool)))
            rows = []
            for m in sample:
                limit = max(60.0, limit_factor * base)
                status, took, tail = box.run(m, timeout=limit)
                first = status
                if status == "timeout":  # once more, with twice the time (and three
                    # times the pools' 30 s): a loaded machine times out too, and a
                    # timeout is not a failed assertion
                    print(f"timeout   {took:6.1f}s {m.id}  (again, limit {2 * limit:.0f} s)",
                          flush=True)
                    status, took, tail = box.run(m, timeout=2 * limit, pool_timeout=90.0)
                rows.append({**asdict(m), "id": m.id, "status": status, "first": first,
                             "seconds": round(took, 1),
                             "tail": tail if status != "killed" else tail[-300:]})
                print(f"{status:9s} {took:6.1f}s {m.id}  | {m.text[:70]}", flush=True)
            counts = {k: sum(r["status"] == k for r in rows)
                      for k in ("killed", "timeout", "survived")}
            results["modules"][module] = {  # type: ignore[index]
                "mutants": len(pool), "sampled": len(rows), **counts,
                "baseline_s": round(base, 1), "rows": rows}
            print(f"== {module}: {counts['killed']}/{len(rows)} killed by a failing test, "
                  f"{counts['timeout']} timed out twice, {counts['survived']} survived, "
                  f"of {len(pool)} mutants (baseline {base:.0f} s)", flush=True)
    finally:
        box.close()
    return results


def baseline(modules: list[str]) -> int:
    """Run each module's selection unmutated; its time (1 if one fails)."""
    global _baseline_target
    box = Sandbox()
    failed = 0
    try:
        for module in modules:
            _baseline_target = module
            status, took, tail = box.run(None, timeout=1800)
            print(f"{'passes' if status == 'survived' else status:9s} {took:6.1f}s {module}",
                  flush=True)
            if status != "survived":
                failed += 1
                print(tail, flush=True)
    finally:
        box.close()
    return 1 if failed else 0


def check(seed: int, count: int, budget: float) -> int:
    """CI: a seeded sample of the recorded killed mutants, re-run within
    ``budget`` seconds; 1 if one survives now."""
    global _baseline_target
    with open(KILLED_FILE, encoding="utf-8") as f:
            rows = json.load(f)["killed"]
    recorded = [(Mutant(**{k: r[k] for k in ("path", "line", "col", "op", "text", "index")}),
                 float(r.get("seconds", 60.0))) for r in rows]
    rng = random.Random(seed)
    order = rng.sample(recorded, len(recorded))
    box = Sandbox()
    deadline = time.monotonic() + budget
    survived: list[tuple[Mutant, str]] = []
    stale: list[str] = []
    inconclusive: list[str] = []
    ran = 0
    try:
        for m, seconds in order:
            if ran >= count or time.monotonic() > deadline:
                break
            if seconds > deadline - time.monotonic():
                continue  # (its selection took longer than the box has left: another one)
            now = relocate(m)
            if now is None:
                stale.append(m.id)
                continue
            _baseline_target = now.path
            # Its own limit, not what is left of the box: a run cut short by the
            # box's end would count as neither killed nor survived.
            status, took, tail = box.run(now, timeout=max(60.0, 4 * seconds))
            print(f"{status:9s} {took:6.1f}s {now.id}  | {now.text[:70]}", flush=True)
            if status == "timeout":
                inconclusive.append(now.id)  # (not counted: a slow machine, or a hang)
                continue
            ran += 1
            if status == "survived":
                survived.append((now, tail))
    finally:
        box.close()
    for gone in stale:
        print(f"stale (the code it mutated is gone; re-record): {gone}")
    for mid in inconclusive:
        print(f"timed out, not counted: {mid}")
    print(f"{ran} recorded-killed mutants re-run, {len(survived)} survived")
    for m, tail in survived:
        print(f"SURVIVED {m.id}: {m.text}\n{tail}", file=sys.stderr)
    return 1 if survived else 0


def run_ids(ids: list[str], tests: list[str] | None, out: str | None = None) -> int:
    """Run the mutants ``ids`` (against ``tests``, else their module's
    selection); 1 if one survives.  ``out``: the results as ``sweep`` writes
    them (``record`` takes only those run against their module's selection)."""
    global _baseline_target
    box = Sandbox()
    survived = 0
    rows: list[dict[str, object]] = []
    try:
        for mid in ids:
            path = mid.split(":")[0]
            m = next((c for c in mutants_of(path) if c.id == mid), None)
            if m is None:
                print(f"no mutant {mid}")
                survived += 1
                continue
            if tests:
                TARGETS[path] = tests
            _baseline_target = path
            status, took, tail = box.run(m, timeout=1800)
            print(f"{status:9s} {took:6.1f}s {m.id}  | {m.text[:70]}", flush=True)
            survived += status == "survived"
            rows.append({**asdict(m), "id": m.id, "status": status, "seconds": round(took, 1),
                         "tests": tests, "tail": tail[-300:]})
    finally:
        box.close()
    if out:
        with open(out, "w", encoding="utf-8") as f:
            json.dump({"modules": {"run": {"rows": rows}}}, f, indent=1)
    return 1 if survived else 0


def record(paths: list[str], max_seconds: float) -> int:
    """Add the killed mutants of sweep results (``--json`` files) to
    :data:`KILLED_FILE`: those whose selection failed within ``max_seconds``
    (CI's sample re-runs them, so fast ones), timeouts left out."""
    data: dict[str, list[dict[str, object]]] = {"killed": []}
    if os.path.exists(KILLED_FILE):
        with open(KILLED_FILE, encoding="utf-8") as f:
            data = json.load(f)
    have = {r["id"] for r in data["killed"]}
    added = 0
    for path in paths:
        with open(path, encoding="utf-8") as f:
            res = json.load(f)
        for module in res["modules"].values():
            for r in module["rows"]:
                if r["status"] == "killed" and r["seconds"] <= max_seconds and \
                        r["id"] not in have and not r.get("tests"):
                    keep = ("path", "line", "col", "op", "text", "index", "id", "seconds")
                    data["killed"].append({k: r[k] for k in keep})
                    have.add(r["id"])
                    added += 1
    data["killed"].sort(key=lambda r: (r["path"], r["line"], r["col"], r["op"]))
    with open(KILLED_FILE, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    print(f"{added} killed mutants recorded ({len(data['killed'])} in all)")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("sweep", help="kill rates of a seeded sample per module")
    s.add_argument("--modules", nargs="*", default=list(TARGETS))
    s.add_argument("--per-module", type=int, default=10)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--limit-factor", type=float, default=4.0,
                   help="a mutant's time limit, in multiples of the unmutated run")
    s.add_argument("--json", help="write the results here")
    c = sub.add_parser("check", help="CI: recorded killed mutants must stay killed")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--count", type=int, default=6)
    c.add_argument("--budget", type=float, default=240.0, help="seconds")
    b = sub.add_parser("baseline", help="time each module's selection unmutated")
    b.add_argument("modules", nargs="*", default=list(TARGETS))
    ls = sub.add_parser("list", help="a module's mutants")
    ls.add_argument("module")
    one = sub.add_parser("run", help="run the given mutants (ids as `list` prints them)")
    one.add_argument("ids", nargs="+")
    one.add_argument("--tests", nargs="*", help="another test selection (pytest arguments)")
    one.add_argument("--json", help="write the results here (as sweep does)")
    r = sub.add_parser("record", help="add the killed mutants of sweep results to the record")
    r.add_argument("results", nargs="+")
    r.add_argument("--max-seconds", type=float, default=40.0)
    args = p.parse_args(argv)
    if args.cmd == "record":
        return record(args.results, args.max_seconds)
    if args.cmd == "run":
        return run_ids(args.ids, args.tests, args.json)
    if args.cmd == "baseline":
        return baseline(args.modules)
    if args.cmd == "list":
        for m in mutants_of(args.module):
            print(f"{m.id}  | {m.text}")
        return 0
    if args.cmd == "check":
        return check(args.seed, args.count, args.budget)
    unknown = [m for m in args.modules if m not in TARGETS]
    if unknown:
        p.error(f"no test selection for {unknown}; add them to TARGETS")
    res = sweep(args.modules, args.per_module, args.seed, args.limit_factor)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
