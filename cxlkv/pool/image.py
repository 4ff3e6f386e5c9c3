"""An open, formatted pool image: probe, permission check, map, choose a
superblock, write a new superblock generation, close.

This is the pool as bytes and a superblock; attaching as a node, the lock,
the allocator and the KV cache are cxlkv.api.Pool's (which is a PoolImage).
"""
from __future__ import annotations

import gc
import os
import sys
import traceback

from cxlkv.errors import PoolInvalid, PoolReadOnly, PoolTruncated
from cxlkv.pool import device, layout, superblock
from cxlkv.pool.superblock import Superblock


def read_superblocks(m) -> tuple[bytes, bytes]:
    """Both superblock copies, read from memory (invalidated first)."""
    n = layout.SB_COPIES * layout.SB_SIZE
    if m.size < n:
        return m.read(0, m.size), b""
    m.invalidate(0, n)
    return m.read(layout.SB_OFFSETS[0], layout.SB_SIZE), m.read(layout.SB_OFFSETS[1], layout.SB_SIZE)


class PoolImage:
    """An open, formatted pool (not attached).

    `warnings` collects what --force overrode.
    """

    def __init__(self, target: device.Target, mapping, selection: superblock.Selection,
                 read_only: bool, warnings: list[str]):
        self.target = target
        self.mapping = mapping
        self._sel = selection
        self.read_only = read_only
        self.warnings = warnings

    # -- opening -------------------------------------------------------
    @classmethod
    def open(cls, path: str | os.PathLike, *, writable: bool = True, force: bool = False,
             populate: bool = False) -> "PoolImage":
        """Open a formatted pool.

        Raises PoolNotFound, UnsafePermissions (world-readable or -writable,
        unless force), PoolInvalid subclasses, PoolIncompatible, DeviceError.
        An unknown ro_compat feature opens the pool read-only.
        """
        t = device.probe(path)
        warnings = []
        w = device.check_permissions(t, force)
        if w:
            warnings.append(w)
        if t.size < layout.SB_COPIES * layout.SB_SIZE:
            raise PoolTruncated(
                f"{t.path} is {t.size} bytes: too small to hold a pool "
                f"(the superblocks alone take {layout.SB_COPIES * layout.SB_SIZE})", path=t.path)
        m = device.map_target(t, writable=writable, populate=populate)
        try:
            try:
                sel = superblock.select(*read_superblocks(m))
            except PoolInvalid as e:
                if t.path in e.message:
                    raise
                raise type(e)(f"{t.path}: {e.message}", path=t.path, hint=e.hint) from None
            sb = sel.sb
            if sb.pool_size > t.size:
                raise PoolTruncated(
                    f"{t.path} is {t.size} bytes but its superblock says the pool is "
                    f"{sb.pool_size} bytes: the file or device was truncated", path=t.path,
                    hint="restore the original size, or reformat with cxlkv format --force")
            if writable and sb.read_only_features:
                warnings.append(f"{t.path}: unknown read-only-compatible features "
                                f"{sb.read_only_features:#x}; opened read-only")
                m.close()
                m = device.map_target(t, writable=False, populate=populate)
                writable = False
            for copy, problem in sel.problems.items():
                warnings.append(f"superblock copy {copy} is bad ({problem}); "
                                f"using copy {sel.copy}")
        except BaseException:
            m.close()
            raise
        return cls(t, m, sel, not writable, warnings)

    # -- properties ----------------------------------------------------
    @property
    def path(self) -> str:
        return self.target.path

    @property
    def sb(self) -> Superblock:
        return self._sel.sb

    @property
    def superblock_copy(self) -> str:
        return self._sel.copy

    @property
    def superblock_problems(self) -> dict[str, str]:
        return dict(self._sel.problems)

    def region(self, name: str) -> tuple[int, int]:
        return self.sb.regions[name]

    # -- superblock update ------------------------------------------------
    def update_superblock(self, **changes) -> Superblock:
        """Write a new superblock generation into the copy that is not current.

        The current copy stays intact until the new one is written and
        flushed, so a torn write leaves the old generation readable.
        """
        if self.read_only:
            raise PoolReadOnly(f"{self.path}: pool is open read-only", path=self.path)
        new = self.sb.replace(seq=self.sb.seq + 1, **changes)
        target = "B" if self._sel.copy == "A" else "A"
        self.mapping.write(layout.SB_OFFSETS["AB".index(target)], new.encode())
        self._sel = superblock.Selection(new, target, {})
        return new

    # -- lifetime --------------------------------------------------------
    def close(self) -> None:
        handling = sys.exc_info()[1]        # closing from an except block?
        if self.mapping is not None and not self.mapping.closed:
            try:
                self.mapping.close()
            except BufferError:
                if handling is None:
                    raise
                # an error raised from inside cxlkv (NodeFenced mid-allocation,
                # say) keeps the frames it passed alive, and with them views
                # of the pool they held: let them go, then close
                e = handling
                while e is not None:
                    traceback.clear_frames(e.__traceback__)
                    e = e.__context__
                gc.collect()
                self.mapping.close()

    def __enter__(self) -> "PoolImage":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<cxlkv.Pool {self.path} {self.sb.sync} {self.sb.pool_size} bytes>"


