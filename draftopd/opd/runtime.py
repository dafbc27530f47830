"""How the driver reaches the roles: Ray actors, or the plain role objects in the driver's own process.

The session speaks to every role as `handle.method.remote(...)` and resolves the
results with its runtime's `get` and `wait`. `RayRuntime` is Ray itself.
`InProcessRuntime` (`ray.in_process: true`) runs each call at once, in order, on
the plain objects: the same driver code, without Ray, so that its accounting
(policy versions, syncs, checkpoints, what reaches the driver) is testable on its
own and a run can be stepped through in a debugger. One learner rank and the
object-store sync only: collective transports need their peers running
concurrently.
"""

from __future__ import annotations

from typing import Any


class InProcessRef:
    """The finished result (or the exception) of one call, standing where a Ray object reference would."""

    def __init__(self, value: Any = None, error: BaseException | None = None):
        self.value, self.error = value, error

    def result(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.value


class _Method:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args, **kwargs) -> InProcessRef:
        args = [resolve(a) if isinstance(a, InProcessRef) else a for a in args]  # as Ray resolves top-level refs
        try:
            return InProcessRef(self.fn(*args, **kwargs))
        except Exception as exc:  # raised where the result is read, as with Ray
            return InProcessRef(error=exc)


class InProcessHandle:
    """A plain role object called the way a Ray actor handle is called."""

    def __init__(self, obj):
        self.obj = obj

    def __getattr__(self, name: str) -> _Method:
        return _Method(getattr(self.obj, name))


class InProcessClass:
    """What `ray.remote(cls).options(...)` is for an in-process role: `.remote(*args)` builds the object here."""

    def __init__(self, cls):
        self.cls = cls

    def remote(self, *args, **kwargs) -> InProcessHandle:
        return InProcessHandle(self.cls(*args, **kwargs))


def resolve(ref):
    """The value behind a reference of either kind (what a role does with a reference it was handed)."""
    if isinstance(ref, InProcessRef):
        return ref.result()
    import ray

    return ray.get(ref)


class InProcessRuntime:
    ActorDied: type[BaseException] = type("NeverRaised", (Exception,), {})  # an in-process role cannot die alone

    def __init__(self, observe=None):
        self.observe = observe  # called with every value the driver receives (tests)

    def get(self, refs, timeout: float | None = None):
        values = [r.result() for r in refs] if isinstance(refs, list) else refs.result()
        if self.observe is not None:
            self.observe(values)
        return values

    def wait(self, refs: list, num_returns: int = 1, timeout: float | None = None):
        return refs[:num_returns], refs[num_returns:]  # every call has finished already


class RayRuntime:
    def __init__(self):
        import ray

        self.ActorDied = ray.exceptions.RayActorError
        self.get, self.wait = ray.get, ray.wait
