"""How many file descriptors one reader or writer of packs may keep open: a share of the process's limit."""

from __future__ import annotations


def descriptor_share(cap: int) -> int:
    """``cap``, or an eighth of the descriptors this process may open where that is fewer (at least 2): the
    rest stay for the storage library, the process group's sockets and the user's files."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):  # no such limit here
        return cap
    if soft == resource.RLIM_INFINITY or soft <= 0:
        return cap
    return max(2, min(cap, soft // 8))
