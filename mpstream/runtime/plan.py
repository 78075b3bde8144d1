"""Recording and verifying event plans.

:func:`record_plan` runs the C++ scheduler over a schedule without any device
and returns every stream operation it would issue. :func:`verify_plan`
checks the one property that matters: each task runs after the tasks whose
tensors it reads, through same-stream order or through an event recorded
after the producer and waited on before the consumer. Data dependencies are
derived here from what each task means, not taken from the scheduler, so the
check is independent of the code it checks.
"""

from __future__ import annotations

import numbers
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .._words import count_of
from ..schedules.placement import default_ranks, virtual_stages_for
from ..schedules.schedule import Kind, Order, Schedule, Topology
from .scheduler import EventScheduler, PlanOp
from .stream import as_device

__all__ = ["Plan", "PlanError", "record_plan", "verify_plan"]


class PlanError(AssertionError):
    """A plan lets a task run before a tensor it reads is ready."""


@dataclass
class Plan:
    """A recorded plan: the operations and what each slot is."""

    ops: list[PlanOp]
    slot_names: list[str]
    slot_devices: list[torch.device]
    stages: int
    reads: tuple[tuple[int, ...], ...] | None = None  # the stage graph; None: a chain

    def producers(self, stage: int) -> tuple[int, ...]:
        """The stages ``stage`` reads (-1: the input)."""
        return self.reads[stage] if self.reads is not None else (stage - 1,)

    @property
    def callers(self) -> list[int]:
        """The caller slots (the user's streams), one per device."""
        return [i for i, name in enumerate(self.slot_names) if name.startswith("caller@")]

    def __str__(self) -> str:
        lines = []
        for op in self.ops:
            if op.task == -1 and op.stage == -1:
                what = "source" if op.op == "record" else "join"
            else:
                what = f"{op.kind}(stage={op.stage}, micro={op.micro})"
                if op.kind in ("copy", "copy_grad") and op.peer != op.stage + 1:
                    what = f"{op.kind}(stage={op.stage}, peer={op.peer}, micro={op.micro})"
            ev = f" e{op.event}" if op.event >= 0 else ""
            lines.append(f"{op.op:6s} {self.slot_names[op.slot]:28s}{ev:5s} {what}")
        return "\n".join(lines)


def record_plan(
    schedule: Order,
    stages: int,
    chunks: int,
    devices: Sequence[str | torch.device] | None = None,
    *,
    input_device: str | torch.device | None = None,
    target_device: str | torch.device | None = None,
    backward: bool = False,
    force_copies: bool = False,
    reads: Sequence[Sequence[int]] | None = None,
    virtual_stages: int | None = None,
) -> Plan:
    """Records the stream operations of a whole run without any device.

    Args:
        schedule: a built-in schedule's name (``'gpipe'``, ``'1f1b'``, ...,
            ``mpstream.SCHEDULES``) or an explicit order of actions
            (training schedules, with backward tasks).
        stages: number of stages.
        chunks: number of micro-batches.
        devices: the device of each stage (they need not exist here);
            default a ``cuda:<rank>`` per stage, its rank as the schedule
            places it (as :func:`~mpstream.simulate` places them): one per
            stage, in a V, or round-robin given ``virtual_stages``.
        input_device: where the batch sits; default the first stage's device.
        target_device: where a training step's targets sit; default the last
            stage's device (no target transfers). Needs ``backward``.
        backward: schedule backward tasks too.
        force_copies: copy between every pair of stages, as
            ``Pipe(force_copies=True)``.
        reads: the stage graph: per stage, the stages it reads (-1: the
            input), as :attr:`~mpstream.schedules.schedule.Topology.reads`; default a
            chain.
        virtual_stages: stages per rank for the schedules of several stages
            per rank (default inferred from the devices, placed round-robin
            or in a V); refused for the others, as ``Pipe`` and
            ``simulate`` refuse it.

    Returns:
        The recorded :class:`Plan`.

    Raises:
        TypeError: ``devices`` is one device, not a list.
        ValueError: ``stages`` or ``chunks`` is not a positive int, ``devices`` has
            another length or an entry that is not a device (``input_device``
            and ``target_device`` too), or the schedule does not fit them
            (``virtual_stages`` given to a schedule of a rank per stage, or
            missing for a round-robin one without ``devices``, included).
    """
    for name, count in (("stages", stages), ("chunks", chunks)):
        # Any integer (numpy's too, as Schedule takes them), not True as 1.
        if isinstance(count, bool) or not isinstance(count, numbers.Integral) or count < 1:
            raise ValueError(f"{name} must be a positive int, got {count!r}")
    stages, chunks = int(stages), int(chunks)
    if isinstance(devices, (str, torch.device)):
        # A string would be read a character per stage.
        raise TypeError(f"devices must be a list with one device per stage, got {devices!r}")
    listed = devices
    if not listed:
        ranks, virtual_stages = default_ranks(schedule, stages, virtual_stages)
        listed = [f"cuda:{r}" for r in ranks]
    devs = [as_device(d, f"devices[{i}]") for i, d in enumerate(listed)]
    if len(devs) != stages:
        raise ValueError(
            f"devices has {count_of(len(devs), 'entry', 'entries')} for {count_of(stages, 'stage')}"
        )
    src = as_device(input_device, "input_device") if input_device is not None else devs[0]
    labels = list(dict.fromkeys(devs))
    graph = tuple(tuple(r) for r in reads) if reads is not None else None
    topology = Topology(
        graph if graph is not None else tuple((s - 1,) for s in range(stages)),
        tuple(labels.index(d) for d in devs),
        labels.index(src) if src in labels else -1,
        force_copies,
    )
    copy_target = (
        target_device is not None and as_device(target_device, "target_device") != devs[-1]
    )
    virtual = virtual_stages_for(schedule, devs, virtual_stages)
    sched = Schedule(
        schedule,
        stages,
        chunks,
        topology,
        backward=backward,
        copy_target=copy_target,
        virtual_stages=virtual,
    )
    runner = EventScheduler(devs, virtual=True)
    runner.recording = True
    runner.begin_run(sched)
    for task in sched.tasks:
        runner.end(runner.begin(task.index))
    runner.join()
    return Plan(runner.plan(), runner.slot_names, runner.slot_devices, stages, graph)


# A task, as verify_plan names it: (kind, stage, peer, micro).
Key = tuple[str, int, int, int]


def _producers(op: PlanOp, plan: Plan, copies: dict[tuple[str, int, int], list[int]]) -> list[Key]:
    """What ``op``'s task reads, derived from what the task means.

    ``copies[(kind, producer, micro)]`` lists the peers of the copies (or
    gradient copies) of that producer's value: the one whose peer shares a
    reader's device is the one that reader gets it from.
    """
    kind, s, m, peer = op.kind, op.stage, op.micro, op.peer
    device = plan.slot_devices

    def via(p: int, q: int, what: str) -> int | None:
        """The peer of the copy that brings p's value to q's device (q's own
        copy if there is one: forced copies go to each reading stage)."""
        peers = copies.get((what, p, m), [])
        if q in peers:
            return q
        return next((g for g in peers if device[2 * g] == device[2 * q]), None)

    if kind == Kind.FORWARD.label:
        deps: list[Key] = []
        for p in plan.producers(s):
            g = via(p, s, "copy")
            if g is not None:
                deps.append(("copy", p, g, m))
            elif p >= 0 and device[2 * p] != device[2 * s]:
                deps.append(("copy", p, s, m))  # none in the plan: a value on another device
            elif p >= 0:
                deps.append(("forward", p, p, m))
        if ("target", s, m) in copies:
            deps.append(("target", s, s, m))
        return deps
    if kind == Kind.COPY.label:
        return [("forward", s, s, m)] if s >= 0 else []
    if kind == Kind.WEIGHT.label:
        # Reads what the split backward kept: the graph and the gradients
        # that flowed into it.
        return [("backward", s, s, m)]
    readers = [q for q in range(plan.stages) if s in plan.producers(q)]
    if kind == Kind.BACKWARD.label:
        deps = [("forward", s, s, m)]
        for q in readers:
            g = via(s, q, "copy_grad")
            if g is None and device[2 * q] != device[2 * s]:
                g = q  # none in the plan: a gradient on another device
            deps.append(("copy_grad", s, g, m) if g is not None else ("backward", q, q, m))
        return deps
    if kind == Kind.COPY_GRAD.label and op.task >= 0:
        return [("backward", q, q, m) for q in readers if via(s, q, "copy_grad") == peer]
    return []


def verify_plan(plan: Plan) -> None:
    """Checks that every task is ordered after what it reads.

    Every slot is treated as an independent stream: only program order on a
    slot and record→wait edges order work across slots (no implicit barrier
    is assumed for copies; an ``autograd`` op is the wait autograd's engine
    issues itself before a gradient copy's consumer). A task is ready when an
    op after its ``run`` on the same slot, or anything ordered after that, is
    reached, so each consumer's ``run`` must be reachable from each
    producer's ``run``. Each stage compute and each transfer from the host
    must also be ordered after the caller's source event of its device, and
    each caller slot after the last work of every stream on its device.

    A value read on another device must come through a copy task of the
    plan. A plan may hold several runs (each begins with the callers' source
    records); a task reads what its own run produced. Only read-after-write
    order is checked: that the allocator does not hand a tensor's memory to
    another stream too early (``record_stream``) is not in the plan, nor is
    work autograd queues by itself, such as a tied weight's gradient sum.

    Args:
        plan: a :class:`Plan`, as :func:`record_plan` returns one.

    Raises:
        TypeError: ``plan`` is not a :class:`Plan`.
        PlanError: listing every violation.
    """
    if not isinstance(plan, Plan):
        raise TypeError(
            f"verify_plan takes a Plan, as mpstream.record_plan(...) returns it, got "
            f"{type(plan).__name__}"
        )
    ops = plan.ops
    n = len(ops)
    edges: dict[int, list[int]] = defaultdict(list)
    last_on_slot: dict[int, int] = {}
    last_record: dict[int, int] = {}
    run_of = [0] * n  # which run each op belongs to (see the docstring)
    run = 0
    done: dict[tuple[int, Key], int] = {}
    callers = plan.callers

    def source_record(j: int) -> bool:
        return ops[j].op == "record" and ops[j].task == -1 and ops[j].slot in callers

    source: dict[int, int] = {}
    sources_at: dict[int, dict[int, int]] = {}  # run op -> the sources before it
    for i, op in enumerate(ops):
        if source_record(i) and i and not source_record(i - 1):
            run += 1
        run_of[i] = run
        if op.slot in last_on_slot:
            edges[last_on_slot[op.slot]].append(i)
        last_on_slot[op.slot] = i
        if op.op == "record":
            last_record[op.event] = i
            if op.task == -1 and op.stage == -1 and op.slot in callers:
                source[op.slot] = i
        elif op.op in ("wait", "sync", "autograd"):
            if op.event not in last_record:
                raise PlanError(f"op {i} waits on event {op.event}, which was never recorded")
            edges[last_record[op.event]].append(i)
        elif op.op == "run":
            done[(run, (op.kind, op.stage, op.peer, op.micro))] = i
            sources_at[i] = dict(source)

    reach_cache: dict[int, set[int]] = {}

    def reach(a: int) -> set[int]:
        if a not in reach_cache:
            seen = {a}
            stack = [a]
            while stack:
                for b in edges[stack.pop()]:
                    if b not in seen:
                        seen.add(b)
                        stack.append(b)
            reach_cache[a] = seen
        return reach_cache[a]

    copies: dict[int, dict[tuple[str, int, int], list[int]]] = defaultdict(
        lambda: defaultdict(list)
    )
    for i, op in enumerate(ops):
        if op.op == "run" and op.kind in ("copy", "copy_grad", "target"):
            copies[run_of[i]][(op.kind, op.stage, op.micro)].append(op.peer)
    problems: list[str] = []
    caller_of = {
        s: next(c for c in callers if plan.slot_devices[c] == plan.slot_devices[2 * s])
        for s in range(plan.stages)
    }
    for i, op in enumerate(ops):
        if op.op != "run":
            continue
        what = f"{op.kind}(stage={op.stage}, micro={op.micro})"
        for dep in _producers(op, plan, copies[run_of[i]]):
            if (run_of[i], dep) not in done:
                problems.append(f"{what} reads {dep}, which never completed before it")
            elif i not in reach(done[(run_of[i], dep)]):
                problems.append(
                    f"{what} is not ordered after {dep[0]}(stage={dep[1]}, micro={dep[3]})"
                )
        input_copy = op.kind == "copy" and op.stage == -1
        if op.kind in ("forward", "backward", "weight", "target") or input_copy:
            src = sources_at[i].get(caller_of[op.peer if input_copy else op.stage])
            if src is not None and i not in reach(src):
                problems.append(f"{what} is not ordered after the caller's source event")
        if op.kind == "copy_grad" and op.task == -1:
            # Autograd runs the consumer (this micro-batch's backward of
            # the stage) on the stage's compute stream: a wait of its own
            # (ours, or autograd's engine's) must order it after the copy.
            compute = 2 * op.stage
            orders = [
                j
                for j in range(i + 1, n)
                if ops[j].slot == compute
                and ops[j].op in ("wait", "sync", "autograd")
                and (ops[j].kind, ops[j].stage, ops[j].peer, ops[j].micro)
                == (op.kind, op.stage, op.peer, op.micro)
            ]
            if not any(j in reach(i) for j in orders):
                problems.append(f"{what}: stage {op.stage}'s compute stream never waits for it")
    for r in range(run + 1):
        problems += _unjoined(plan, [i for i in range(n) if run_of[i] == r], reach)
    if problems:
        raise PlanError("invalid plan:\n  " + "\n  ".join(problems))


def _unjoined(plan: Plan, run: list[int], reach: Callable[[int], set[int]]) -> list[str]:
    """The caller slots of one run (its ops' indices) not ordered after the
    last work of a stream on their device.

    The run ends with the join (waits on caller slots); records after it
    (gradient copies issued by autograd) are ordered by autograd's own final
    sync, not by the join.
    """
    ops, callers = plan.ops, plan.callers
    end = 1 + max(
        [i for i in run if ops[i].task >= 0]
        + [i for i in run if ops[i].slot in callers and ops[i].op != "record"],
        default=-1,
    )
    joined = [i for i in run if i < end]
    problems = []
    for c in callers:
        joins = [j for j in joined if ops[j].slot == c]
        for x in range(len(plan.slot_names)):
            if x in callers or plan.slot_devices[x] != plan.slot_devices[c]:
                continue
            records = [j for j in joined if ops[j].slot == x and ops[j].op == "record"]
            if records and not any(j in reach(records[-1]) for j in joins):
                caller, stream = plan.slot_names[c], plan.slot_names[x]
                problems.append(f"{caller} is not ordered after the last work on {stream}")
    return problems
