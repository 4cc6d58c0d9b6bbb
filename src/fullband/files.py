"""Safe writes into users' folders. An output folder is written as a locked temporary sibling and renamed into
place; an existing folder is replaced only when it is recognisably an earlier output of the same kind and the
caller asked for it; a run directory belongs to one process at a time; a full disk or a read-only folder is
reported as such, with the path. Also: where the token cache lives, and figures (matplotlib) written as PNG."""

from __future__ import annotations

import contextlib
import errno
import glob
import hashlib
import json
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from fullband.errors import ConfigError, FullbandError

try:
    import fcntl
except ImportError:  # not POSIX: no locks, every other check still runs
    fcntl = None

TEMP_SUFFIX = ".tmp"
_FULL_DISK_ERRNOS = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}
_LOW_SPACE = 1 << 20  # below this many free bytes a failed write is taken for a full disk


class OutputError(FullbandError, OSError):
    """An output path cannot be written: it holds files fullband did not write, another process owns it, it is
    read-only, or the disk is full."""


# ---------------------------------------------------------------------- what counts as ours
@dataclass(frozen=True)
class Kind:
    """A kind of output folder: the entries fullband writes in it, and a check that a folder is one of them.

    `names` are exact entry names (files or folders), `patterns` regular expressions for numbered ones;
    `subfolders` maps a folder entry to the Kind its own contents must be (e.g. a checkpoint's eval/)."""

    label: str
    names: frozenset[str]
    patterns: tuple[str, ...] = ()
    marker: Callable[[Path], bool] | None = None  # the folder says it is one (e.g. config.json's format)
    subfolders: dict[str, "Kind"] = field(default_factory=dict)

    def allows(self, name: str) -> bool:
        return name in self.names or any(re.fullmatch(p, name) for p in self.patterns)

    def foreign(self, folder: Path) -> list[str]:
        """Entries of `folder` this kind never writes (those of a recognised subfolder checked recursively)."""
        out = []
        for entry in sorted(folder.iterdir(), key=lambda p: p.name):
            sub = self.subfolders.get(entry.name)
            if sub is not None and entry.is_dir() and not entry.is_symlink():
                out += [f"{entry.name}/{name}" for name in sub.foreign(entry)]
            elif not self.allows(entry.name) or entry.is_symlink() or (entry.is_dir() and sub is None):
                out.append(entry.name)
        return out

    def recognises(self, folder: Path) -> bool:
        return (self.marker is None or self.marker(folder)) and not self.foreign(folder)


def describe_entries(names: list[str], n: int = 5) -> str:
    more = f" and {len(names) - n} more" if len(names) > n else ""
    return ", ".join(names[:n]) + more


def symlink_loop(path: str | Path) -> Path | None:
    """The first part of `path` that is a symlink loop (links that lead back to themselves never resolve), or None."""
    path = Path(path)
    try:
        os.stat(path)
        return None
    except OSError as err:
        if err.errno != errno.ELOOP:
            return None
    for part in (*reversed(path.parents), path):
        try:
            os.stat(part)
        except OSError as err:
            if err.errno == errno.ELOOP:
                return part
    return path


def check_no_loop(path: str | Path, what: str, error: type[FullbandError] = OutputError) -> None:
    """Raise `error` when `path` is, or goes through, a symlink loop: nothing can be written there or read back."""
    loop = symlink_loop(path)
    if loop is not None:
        where = "is a symlink loop" if loop == Path(path) else f"goes through a symlink loop at {str(loop)!r}"
        raise error(f"{what} {str(path)!r} {where} (links that lead back to themselves never resolve); accepted: "
                    "a path without one")


def check_destination(dst: str | Path, kind: Kind, *, overwrite: bool, sources: Iterable[str | Path] = (),
                      flag: str = "--overwrite", error: type[FullbandError] = OutputError) -> bool:
    """Raise `error` unless `dst` may receive a new `kind` folder; returns whether an old one is replaced.

    Accepted: an absent path, an empty folder, or (with `overwrite`) a folder that is recognisably an earlier
    `kind` output. Never a plain file, a folder holding anything fullband did not write, or one holding a source.
    `error` is the class raised (OutputError unless the caller's domain has its own)."""
    dst = Path(dst)
    check_no_loop(dst, "output", error)
    for src in sources:
        check_no_loop(src, "source", error)
        if Path(src).resolve().is_relative_to(dst.resolve()):  # the source is the output folder or inside it
            raise error(f"output {str(dst)!r} contains the source {str(src)!r}; replacing it would delete the "
                        "source. Choose an output folder outside it")
    if dst.is_symlink() or (dst.exists() and not dst.is_dir()):
        raise error(f"output {str(dst)!r} exists and is not a folder; accepted: a new or empty folder")
    if not dst.exists():
        return False
    try:
        entries = list(dst.iterdir())
    except OSError as err:
        raise output_error(err, dst, "read the output folder") from None
    if not entries:
        return False
    if not kind.recognises(dst):
        foreign = kind.foreign(dst)
        what = f"it holds {describe_entries(foreign)}" if foreign else "its files do not say fullband wrote them"
        raise error(f"output {str(dst)!r} exists and is not empty, and it is not a {kind.label} written by fullband "
                    f"({what}); nothing was written. Choose a new or empty folder")
    if not overwrite:
        raise error(f"output {str(dst)!r} exists and is not empty: it holds a {kind.label} written earlier; pass "
                    f"{flag} to replace it, or choose a new folder")
    return True


# ---------------------------------------------------------------------- errors of the file system
def free_bytes(path: str | Path) -> int | None:
    path = Path(path)
    for candidate in (path, *path.parents):
        try:
            return shutil.disk_usage(candidate).free
        except OSError:
            continue
    return None


def _errno_in_chain(err: BaseException) -> int | None:
    seen = err
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno is not None:
            return seen.errno
        seen = seen.__cause__ or seen.__context__
    return None


def is_disk_full(err: BaseException, path: str | Path) -> bool:
    """ENOSPC / EDQUOT anywhere in the chain, or a writer that hides the errno (torch.save: 'unexpected pos',
    numpy's tofile: 'N requested and M written', safetensors: 'StorageFull') while the disk has next to no space
    left."""
    if _errno_in_chain(err) in _FULL_DISK_ERRNOS:
        return True
    text = str(err)
    if "No space left" in text or "StorageFull" in text or "os error 28" in text:
        return True
    if _short_write(err):
        free = free_bytes(path)
        return free is not None and free < _LOW_SPACE
    return False


def _short_write(err: BaseException) -> bool:
    """A writer that hides the errno of a write that stopped short: torch.save's "unexpected pos", numpy's tofile
    "N requested and M written" (the gguf package writes with it)."""
    return isinstance(err, RuntimeError | OSError) and any(s in str(err) for s in ("unexpected pos", "write failed",
                                                                                   "requested and"))


def output_error(err: BaseException, path: str | Path, action: str) -> OutputError:
    """The OutputError to raise for `err` while doing `action` on `path`: a full disk, a read-only or
    permission-denied folder, a path through a file, or (else) the system's own message with the path."""
    path = Path(path)
    code = _errno_in_chain(err)
    if is_disk_full(err, path):
        free = free_bytes(path)
        have = f" ({free / 2**20:.1f} MiB free)" if free is not None else ""
        return OutputError(f"the disk is full: could not {action} at {str(path)!r}{have}; free some space or choose "
                           "a folder on another disk. Nothing half-written was kept")
    if code in (errno.EROFS, errno.EACCES, errno.EPERM):
        why = "is on a read-only file system" if code == errno.EROFS else "is not writable (permission denied)"
        return OutputError(f"could not {action}: {str(path)!r} {why}; choose a writable folder")
    if code == errno.ELOOP:
        culprit = symlink_loop(getattr(err, "filename", None) or path) or path
        return OutputError(f"could not {action}: {str(culprit)!r} is a symlink loop (links that lead back to "
                           "themselves never resolve); choose a path without one")
    if code in (errno.ENOTDIR, errno.EEXIST) and isinstance(err, OSError):
        culprit = err.filename or path
        return OutputError(f"could not {action}: a file is in the way at {str(culprit)!r} (a folder is needed "
                           "there); choose another path")
    reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
    if _short_write(err):  # space freed since (by another process), a quota or a file-size limit
        free = free_bytes(path)
        have = f"; {free / 2**20:.0f} MiB are free now" if free is not None else ""
        return OutputError(f"could not {action} at {str(path)!r}: a write stopped short ({reason}): the disk was "
                           f"probably full at that moment{have}, or a quota or file-size limit was reached. Nothing "
                           "half-written was kept")
    return OutputError(f"could not {action} at {str(path)!r}: {reason}")


@contextlib.contextmanager
def writing(path: str | Path, action: str) -> Iterator[None]:
    """Turn a file-system failure inside the block into an OutputError naming `path` (full disk, read-only...)."""
    try:
        yield
    except FullbandError:  # already says what went wrong (several of them are OSErrors too)
        raise
    except Exception as err:  # noqa: BLE001 -- writers that hide the errno (safetensors' SafetensorError) included
        if not isinstance(err, OSError) and not _short_write(err) and not is_disk_full(err, path):
            raise
        raise output_error(err, path, action) from err


def make_folder(path: str | Path, what: str) -> Path:
    """mkdir -p `path`, with an OutputError naming what it is for when a file is in the way or it is read-only."""
    path = Path(path)
    check_no_loop(path, what)
    if path.exists() and not path.is_dir():
        raise OutputError(f"{what} {str(path)!r} is a file; accepted: a folder (or a path that does not exist yet)")
    with writing(path, f"create {what}"):
        path.mkdir(parents=True, exist_ok=True)
    return path


def check_writable(folder: str | Path, what: str) -> None:
    """Raise OutputError now, before any work, when `folder` (or its nearest existing parent) cannot be written."""
    folder = Path(folder)
    check_no_loop(folder, what)
    probe = next((p for p in (folder, *folder.parents) if p.exists()), None)
    if probe is None:
        return
    if not probe.is_dir():
        raise OutputError(f"{what} {str(folder)!r} cannot be created: {str(probe)!r} is a file")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise OutputError(f"{what} {str(folder)!r} is not writable ({str(probe)!r}: permission denied or read-only); "
                          "choose a writable folder")


# ---------------------------------------------------------------------- locks
_HELD: dict[tuple[int, int], list] = {}  # (st_dev, st_ino) -> [fd, count]: re-entrant within one process


def _holder(fd: int) -> str:
    """'pid N' of the process holding a flock on fd's file, read from /proc/locks (Linux), or ''."""
    st = os.fstat(fd)
    ident = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        for line in Path("/proc/locks").read_text().splitlines():
            parts = line.split()
            if "FLOCK" in parts and parts[-3] == ident:
                return f"pid {parts[-4]}"
    except (OSError, IndexError):
        pass
    return ""


class FolderLock:
    """An exclusive lock on a folder (flock on the folder itself: no file added, released when the process dies)."""

    def __init__(self, key: tuple[int, int]) -> None:
        self.key = key

    def release(self) -> None:
        entry = _HELD.get(self.key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            os.close(entry[0])
            del _HELD[self.key]
        self.key = None

    def __enter__(self) -> "FolderLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def try_lock(folder: str | Path) -> FolderLock | str:
    """Lock `folder` (which must exist); returns the lock, or a description of the holder ('pid N' or '')
    when another process holds it."""
    folder = Path(folder)
    fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    st = os.fstat(fd)
    key = (st.st_dev, st.st_ino)
    if key in _HELD:
        os.close(fd)
        _HELD[key][1] += 1
        return FolderLock(key)
    if fcntl is not None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd) or "another process"
            os.close(fd)
            return holder
    _HELD[key] = [fd, 1]
    return FolderLock(key)


def lock_folder(folder: str | Path, what: str, hint: str = "") -> FolderLock:
    """Lock `folder` for this process, or raise OutputError naming who holds it."""
    got = try_lock(folder)
    if isinstance(got, str):
        raise OutputError(f"{what} {str(folder)!r} is in use by another fullband process ({got}); one process at a "
                          f"time may write there. Wait for it to finish{hint}")
    return got


# ---------------------------------------------------------------------- temporary folders
def sweep_temps(parent: Path, pattern: str) -> list[str]:
    """Delete the temporary folders in `parent` whose names fully match the regular expression `pattern` and that
    no live process holds (left by a kill). Returns their names."""
    removed = []
    if not parent.is_dir():
        return removed
    for entry in sorted(parent.iterdir()):
        if not re.fullmatch(pattern, entry.name) or entry.is_symlink() or not entry.is_dir():
            continue
        try:
            got = try_lock(entry)
        except OSError:
            continue
        if isinstance(got, str):
            continue  # its writer is alive
        try:
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry.name)
        finally:
            got.release()
    return removed


def make_temp(parent: Path, prefix: str, suffix: str = TEMP_SUFFIX) -> tuple[Path, FolderLock]:
    """A new temporary folder in `parent`, locked by this process (so a sweep by another one leaves it alone)."""
    for _ in range(5):
        tmp = Path(tempfile.mkdtemp(prefix=prefix, suffix=suffix, dir=parent))
        try:
            lock = try_lock(tmp)
        except FileNotFoundError:  # swept between mkdtemp and the lock: try another name
            continue
        if isinstance(lock, str):
            continue
        if tmp.is_dir():
            return tmp, lock
        lock.release()
    raise OutputError(f"could not create a temporary folder in {str(parent)!r}")


@contextlib.contextmanager
def atomic_folder(dst: str | Path, kind: Kind, *, overwrite: bool = False, sources: Iterable[str | Path] = (),
                  action: str | None = None, flag: str = "--overwrite",
                  error: type[FullbandError] = OutputError) -> Iterator[Path]:
    """Yield a temporary folder to fill; on success it replaces `dst` (see check_destination for what may be
    replaced), on any failure it is removed and `dst` is left as it was. Temporary folders of the same
    destination left by a killed process are removed first."""
    dst = Path(dst)
    sources = list(sources)
    action = action or f"write {kind.label}"
    if dst.parent.is_dir():
        _restore_interrupted_swap(dst.parent, dst)
    check_destination(dst, kind, overwrite=overwrite, sources=sources, flag=flag, error=error)
    parent = make_folder(dst.parent, "parent folder")
    prefix = f".{dst.name}."
    sweep_temps(parent, re.escape(prefix) + ".+" + re.escape(TEMP_SUFFIX))  # the names make_temp gives
    with writing(parent, action):
        tmp, lock = make_temp(parent, prefix)
    try:
        with writing(dst, action):  # the error names the folder asked for, not its temporary
            yield tmp
            replace = check_destination(dst, kind, overwrite=overwrite, sources=sources, flag=flag, error=error)
            publish_folder(tmp, dst, replace=replace)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        lock.release()


OLD_SUFFIX = ".old" + TEMP_SUFFIX


def _restore_interrupted_swap(parent: Path, dst: Path) -> None:
    """A kill between the two renames of publish_folder leaves the previous folder as `.NAME.*.old.tmp` and no `dst`:
    put it back, so the sweep that follows does not take it for debris."""
    if dst.exists() or dst.is_symlink():
        return
    for entry in sorted(parent.glob(f".{glob.escape(dst.name)}.*{OLD_SUFFIX}")):
        got = try_lock(entry)
        if isinstance(got, str):
            continue
        got.release()
        os.rename(entry, dst)
        return


def umask() -> int:
    """The process's umask (read by setting it and setting it back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def publish_folder(tmp: Path, dst: Path, *, replace: bool) -> None:
    """Move the finished folder `tmp` to `dst` (same parent): into an absent or empty `dst` by one rename; with
    replace=True the old `dst` is renamed aside, the new one in, and the old one deleted (a kill between the two
    renames is undone by the next atomic_folder to the same place). The one place fullband publishes a folder."""
    mask = umask()  # what mkdtemp made private (0700) gets the modes a plain mkdir and open would give
    for path in (tmp, *tmp.rglob("*")):
        if not path.is_symlink():
            os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~mask)
    if dst.is_dir() and not replace:  # empty (checked by the caller): make room for the rename
        dst.rmdir()
    if not replace:
        os.rename(tmp, dst)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", suffix=OLD_SUFFIX, dir=dst.parent))
    os.rmdir(old)
    os.rename(dst, old)
    try:
        os.rename(tmp, dst)
    except BaseException:
        os.rename(old, dst)
        raise
    shutil.rmtree(old, ignore_errors=True)


def replace_file(path: str | Path, text: str) -> None:
    """Write `text` to `path` through a temporary sibling and a rename: readers never see half a file."""
    path = Path(path)
    with writing(path, f"write {path.name}"):
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=TEMP_SUFFIX, dir=path.parent)
        try:
            os.fchmod(fd, 0o666 & ~umask())  # mkstemp's 0600 -> what a plain open would give
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise


def cache_root(cfg_dir: str) -> Path:
    """data.cache_dir, else $FULLBAND_CACHE, else $XDG_CACHE_HOME/fullband; refused now if it is a file."""
    if cfg_dir:
        root, what = Path(cfg_dir).expanduser(), "data.cache_dir"
    elif os.environ.get("FULLBAND_CACHE"):
        root, what = Path(os.environ["FULLBAND_CACHE"]).expanduser(), "FULLBAND_CACHE"
    else:
        root, what = Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")).expanduser() / "fullband", "the cache folder"
    check_no_loop(root, what, ConfigError)
    if root.exists() and not root.is_dir():
        raise ConfigError(f"{what}={str(root)!r} is a file; accepted: a folder for the token cache (it is created "
                          "when missing)")
    return root


def plt():
    """matplotlib.pyplot on the Agg backend (no screen needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as pyplot

    return pyplot


def temp_sibling(path: str | Path) -> Path:
    """A new empty file beside `path` to write it through (`.NAME.XXXXXXXX.tmp`: a name no other file has, so a
    user's file is never written over or removed), with the mode a plain open would give."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=TEMP_SUFFIX, dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~umask())
    finally:
        os.close(fd)
    return Path(tmp)


def save_figure(fig, path: Path) -> None:
    """A figure as PNG through a temporary file and a rename (a failure leaves neither); the figure is closed."""
    fig.tight_layout()
    with writing(path, f"write {path.name}"):
        tmp = temp_sibling(path)
    try:
        with writing(path, f"write {path.name}"):
            fig.savefig(tmp, dpi=120, format="png")
            os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
        plt().close(fig)


# ---------------------------------------------------------------------- a folder's record of its files
def file_record(folder: Path, skip: Iterable[str] = ()) -> dict[str, dict]:
    """{name: {"bytes", "sha256"}} of every file in `folder` (recursively, '/'-joined), except `skip`."""
    skip = set(skip)
    out = {}
    for path in sorted(folder.rglob("*")):
        name = path.relative_to(folder).as_posix()
        if path.is_file() and name not in skip:
            out[name] = {"bytes": path.stat().st_size, "sha256": sha256(path)}
    return out


def sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def check_record(folder: Path, record: dict, *, hashes: bool) -> list[str]:
    """Problems of `folder` against its record: missing files, other sizes, (with `hashes`) other contents."""
    problems = []
    for name, want in sorted(record.items()):
        path = folder / name
        if not path.is_file():
            problems.append(f"missing {name}")
            continue
        size = path.stat().st_size
        if size != want.get("bytes"):
            problems.append(f"{name} has {size} bytes, {want.get('bytes')} recorded at save time (truncated or replaced)")
        elif hashes and want.get("sha256") and sha256(path) != want["sha256"]:
            problems.append(f"{name} does not match the sha256 recorded at save time (its contents changed)")
    return problems


# ---------------------------------------------------------------------- reading what users hand us
TEXT_LIMIT = 2**26  # 64 MiB: the largest settings / JSON file read whole (a model's config.json is kilobytes)
LINE_LIMIT = 2**24  # 16 MiB: the longest JSONL line


def file_kind(path: Path) -> str:
    """What a path is: 'a regular file', 'a FIFO', 'a dangling symlink', 'a symlink loop', 'missing', ..."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        return "a dangling symlink" if path.is_symlink() else "missing"
    except (OSError, RuntimeError) as err:
        return "a symlink loop" if getattr(err, "errno", None) == errno.ELOOP else f"unreadable: {err}"
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a folder")):
        if test(mode):
            return name
    return "not a regular file" if not stat.S_ISREG(mode) else "a regular file"


def regular_file(path: str | Path, what: str, *, error: type[FullbandError], limit: int | None = None) -> Path:
    """`path` if it is a regular file (of at most `limit` bytes); else `error` naming it. A FIFO or a device would
    block a reader or never end, a symlink loop never resolves."""
    path = Path(path)
    kind = file_kind(path)
    if kind == "missing":
        raise error(f"{what} {str(path)!r} does not exist")
    if kind != "a regular file":
        raise error(f"{what} {str(path)!r} is {kind}, not a regular file; accepted: a file")
    size = path.stat().st_size
    if limit is not None and size > limit:
        raise error(f"{what} {str(path)!r} is {size:,} bytes; accepted: at most {limit:,} bytes")
    return path


def decode_text(data: bytes, where: str, *, error: type[FullbandError]) -> str:
    """UTF-8 bytes (a byte-order mark read past) -> text; else `error` naming `where` and the byte."""
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise error(f"{where} is UTF-16 text; accepted: UTF-8 (re-save it as UTF-8)")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise error(f"{where} is not UTF-8 text (invalid byte 0x{data[err.start]:02x} at byte {err.start}); "
                    "accepted: UTF-8") from None


def read_text(path: str | Path, what: str, *, error: type[FullbandError], limit: int = TEXT_LIMIT) -> str:
    """The UTF-8 text of a regular file, checked (see regular_file, decode_text)."""
    path = regular_file(path, what, error=error, limit=limit)
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except OSError as err:
        raise error(f"{what} {str(path)!r} cannot be read: {err.strerror or err}") from None
    return decode_text(data, str(path), error=error)


SURROGATE_ESCAPE = re.compile("\\\\u[dD][89a-fA-F]|[\ud800-\udfff]")  # an escape, or one in the text itself


def parse_json(text: str, where: str, *, error: type[FullbandError]):
    """Any JSON value, or `error` naming `where`: malformed, nested too deeply, or holding text that is not Unicode
    (a lone surrogate escape)."""
    try:
        value = json.loads(text)
        if SURROGATE_ESCAPE.search(text):  # a lone surrogate escape decodes, but is not text (a pair is: re-encode)
            json.dumps(value, ensure_ascii=False).encode("utf-8")
    except RecursionError:
        raise error(f"{where}: JSON nested too deeply to read; accepted: at most a few hundred levels") from None
    except json.JSONDecodeError as err:
        raise error(f"{where}: invalid JSON ({err.msg} at line {err.lineno} column {err.colno})") from None
    except UnicodeEncodeError:
        raise error(f"{where}: JSON text holds a lone surrogate (\\ud800-\\udfff escape), which is not Unicode "
                    "text") from None
    return value


def read_json_file(path: str | Path, what: str, *, error: type[FullbandError]):
    """The JSON value of a regular UTF-8 file, every check of read_text and parse_json applied."""
    return parse_json(read_text(path, what, error=error), str(path), error=error)


def jsonl_values(path: str | Path, what: str, *, error: type[FullbandError]) -> Iterator[tuple[str, object]]:
    """('file:line', value) of each non-blank line of a JSONL file, read line by line (no line above LINE_LIMIT)."""
    path = regular_file(path, what, error=error)
    with open(path, "rb") as f:
        for lineno, raw in enumerate(iter(lambda: f.readline(LINE_LIMIT + 1), b""), 1):
            where = f"{path}:{lineno}"
            if len(raw) > LINE_LIMIT:
                raise error(f"{where}: a line of more than {LINE_LIMIT:,} bytes; accepted: one JSON object per line")
            text = decode_text(raw, where, error=error)
            if text.strip():
                yield where, parse_json(text, where, error=error)


def read_json(path: Path) -> dict | None:
    """A JSON object from `path`, or None when it is missing, not a regular file, too large or not one."""
    try:
        data = read_json_file(path, "file", error=FullbandError)
    except FullbandError:
        return None
    return data if isinstance(data, dict) else None
