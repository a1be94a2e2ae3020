"""Which of scorch's ``torch.compile`` modules have run their bodies to the end (``_compile_hook`` registers their
ops' direct CPU kernels once they have). Each of them calls ``ready(__name__)`` as its last line; the hook sets
``listener``. A module of its own, importing nothing, so that the compile modules report to the hook without an
import cycle with it (the hook imports them)."""
from __future__ import annotations

#: the names of the compile modules whose bodies have ended
done: set = set()
#: called with a module's name as it ends, once the hook has loaded the compile modules (else None)
listener = None


def ready(name: str) -> None:
    """The last line of each compile module: its ops exist now."""
    done.add(name)
    if listener is not None:
        listener(name)
