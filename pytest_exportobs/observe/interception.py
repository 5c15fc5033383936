"""Route the calls of one instance's method to listeners, leaving the instance itself untouched.

The method is replaced on the instance's class (a function that looks up the instance called),
never on the instance: ``copy.deepcopy``, pickling (``torch.save(model)``), ``state_dict`` and
``vars(model)`` are what they are without observation, and other instances of the class run the
original method.  When the instance holds its own attribute of that name (``model.forward =
...``, accelerate's hooks, ``torch.compile``'s ``OptimizedModule``), that attribute is replaced
for the time of the observation by a callable that copies and pickles as the original did.

Calls made while torch.compile, torch.export or ``torch.jit.trace`` trace the model run the
original method unobserved, so that tracing sees exactly the model's code.  Listeners of one
instance may come and go in any order (the marker's and ``watch()``'s blocks overlap); the class
gets its attribute back when the last one leaves.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


class Listener(Protocol):
    """Told of each call: ``before_call`` returns a token (``None``: nothing to do after the call),
    ``after_call`` receives it with the call's outputs; a call that raises gets no ``after_call``."""

    def before_call(self, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any: ...

    def after_call(self, instance: Any, token: Any, outputs: Any) -> None: ...


_ORIGINAL = "__exportobs_original__"  # attribute of a class replacement: the function it replaces


def tracing() -> bool:
    """Whether torch.compile / torch.export / torch.jit.trace is tracing the current call."""
    return torch.compiler.is_compiling() or torch.jit.is_tracing()


@dataclass
class _Route:
    """One replaced attribute (of a class or of an instance) and the listeners of each instance."""

    owner: Any
    name: str
    original: Any  # the attribute replaced (for a class: the one its lookup found)
    had_own: bool  # whether ``owner.__dict__`` held the attribute
    replacement: Any = None
    listeners: dict[int, Counter[Listener]] = field(default_factory=dict)

    def call(self, instance: Any, method: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> Any:
        if tracing():  # first, so that a tracer reads nothing else here
            return method(*args, **kwargs)
        listeners = self.listeners.get(id(instance))
        if not listeners:
            return method(*args, **kwargs)
        tokens = [(listener, listener.before_call(instance, args, kwargs)) for listener in list(listeners)]
        outputs = method(*args, **kwargs)
        for listener, token in tokens:
            if token is not None:
                listener.after_call(instance, token, outputs)
        return outputs

    def install(self) -> None:
        if isinstance(self.owner, type):
            self.replacement = _class_replacement(self)
            setattr(self.owner, self.name, self.replacement)
        else:
            self.replacement = _InstanceMethod(self, self.original)
            vars(self.owner)[self.name] = self.replacement

    def uninstall(self) -> None:
        """Give the owner its attribute back, unless someone replaced ours meanwhile."""
        namespace = vars(self.owner)
        if namespace.get(self.name) is not self.replacement:
            return
        if isinstance(self.owner, type):
            if self.had_own:
                setattr(self.owner, self.name, self.original)
            else:
                delattr(self.owner, self.name)
        else:
            namespace[self.name] = self.original


def _class_replacement(route: _Route) -> Callable[..., Any]:
    original = route.original
    binds = hasattr(type(original), "__get__")

    @functools.wraps(original)
    def observed(self: Any, *args: Any, **kwargs: Any) -> Any:
        method = original.__get__(self, type(self)) if binds else original
        return route.call(self, method, args, kwargs)

    setattr(observed, _ORIGINAL, original)
    return observed


class _InstanceMethod:
    """Stands for an instance's own method attribute: calls are routed, while copies and pickles
    of the instance get the original attribute."""

    def __init__(self, route: _Route, original: Callable[..., Any]):
        self._route = route
        self.__wrapped__ = original  # inspect.signature and friends see the original

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._route.call(self._route.owner, self.__wrapped__, args, kwargs)

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        return copy.deepcopy(self.__wrapped__, memo)

    def __reduce_ex__(self, protocol: Any) -> Any:
        return self.__wrapped__.__reduce_ex__(protocol)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__wrapped__, name)


_routes: dict[tuple[int, str], _Route] = {}  # (id(owner), name) -> the route installed there


def _route_for(instance: Any, name: str) -> _Route:
    owner = instance if name in vars(instance) else type(instance)
    route = _routes.get((id(owner), name))
    if route is None:
        if owner is instance:
            route = _Route(owner, name, vars(owner)[name], had_own=True)
        else:
            try:
                found = inspect.getattr_static(owner, name)
            except AttributeError:
                raise ValueError(f"{owner.__name__}.{name} is no method of the class: it cannot be observed") from None
            route = _Route(owner, name, getattr(found, _ORIGINAL, found), had_own=name in vars(owner))
        route.install()
        _routes[(id(owner), name)] = route
    return route


@contextlib.contextmanager
def intercepted(instance: Any, name: str, listener: Listener) -> Iterator[None]:
    """Tell ``listener`` of every call of ``instance.<name>`` made inside the block."""
    route = _route_for(instance, name)
    listeners = route.listeners.setdefault(id(instance), Counter())
    listeners[listener] += 1
    try:
        yield
    finally:
        listeners[listener] -= 1
        if not listeners[listener]:
            del listeners[listener]
        if not listeners:
            del route.listeners[id(instance)]
        if not route.listeners:
            route.uninstall()
            del _routes[(id(route.owner), name)]
