"""The kernel's side of the sandbox: the seccomp filter of every process it starts (SECCOMP_RULES, one
definition), and the confinement of the processes bubblewrap does not start (`Confinement`): the candidate of
`sandbox: landlock` and `guard-only`, and the judge. Everything is set between fork and exec, with no namespace
a user must be allowed to create: an unprivileged uid (as root; no capability kept but CAP_DAC_READ_SEARCH where
the interpreter needs it and a landlock domain bounds it), no new privileges, a landlock domain (read-only
system and interpreter folders, the run's one writable folder and its own /proc/PID, nothing else; no TCP;
signals and abstract unix sockets scoped to the domain) and the seccomp filter. As root with CAP_SYS_ADMIN the
candidate also takes a mount and an IPC namespace of its own, with a size-capped tmpfs as its folder.
rlimits are set by the caller as for bwrap.

Everything a child needs is prepared in the host (`Confinement.__init__`): the child only makes system calls
through ctypes functions looked up beforehand (no import, no allocation beyond ctypes' own call).
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
import sys
import tempfile
import threading

# syscall numbers of the landlock ABI: the same on every architecture (asm-generic numbering)
_CREATE, _ADD_RULE, _RESTRICT = 444, 445, 446
_VERSION = 1  # LANDLOCK_CREATE_RULESET_VERSION
_PATH_BENEATH = 1
# access rights by the ABI version that added them
_FS = {1: (1 << 13) - 1, 2: 1 << 13, 3: 1 << 14, 5: 1 << 15}  # 1: execute .. make_sym; 2 refer; 3 truncate; 5 ioctl
EXECUTE, WRITE_FILE, READ_FILE, READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
MAKE_CHAR, MAKE_BLOCK = 1 << 6, 1 << 11
TRUNCATE, IOCTL_DEV = 1 << 14, 1 << 15
FILE_ONLY = EXECUTE | WRITE_FILE | READ_FILE | TRUNCATE | IOCTL_DEV  # the rights a rule on a file may carry
_NET_TCP = 3  # bind_tcp | connect_tcp (ABI 4)
_SCOPES = 3  # abstract unix sockets | signals (ABI 6)
SIGNAL_SCOPE_ABI = 6  # as a user (same uid as the host), signals to the host are stopped by the domain alone

PR_SET_KEEPCAPS, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, PR_CAP_AMBIENT = 8, 24, 38, 22, 47
PR_CAP_AMBIENT_RAISE, SECCOMP_MODE_FILTER = 2, 2
CAP_DAC_READ_SEARCH = 2
_CAP_V3 = 0x20080522

# The seccomp filter, one definition for every process the sandbox starts. A row: (syscalls, errno, argument test,
# the filters it belongs to): "bwrap" (the candidate inside bubblewrap's namespaces), "bare" (the candidate of the
# landlock and guard-only modes: no namespace hides the host) and "judge" (the judge, in every mode).
ALL, BARE = ("bwrap", "bare", "judge"), ("bare", "judge")
CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x02000000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET, CLONE_PARENT = 0x10000000, 0x20000000, 0x40000000, 0x00008000
# clone's flags (its first argument on every architecture) that leave the run's namespaces or make the host the
# parent of the child (CLONE_NEWTIME exists only for clone3 and unshare: both refused whole)
CLONE_REFUSED = (CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS, CLONE_NEWIPC, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET,
                 CLONE_PARENT)
O_TMPFILE_BIT = 0o20000000  # __O_TMPFILE, the same on x86_64 and aarch64 (O_TMPFILE adds O_DIRECTORY, which differs)
SECCOMP_RULES = (
    # tracing and reading other processes; namespaces and mounts (old and new API); the kernel keyring; eBPF,
    # perf, io_uring, modules, kexec; handles; leaving the run's core
    (("ptrace", "process_vm_readv", "process_vm_writev", "mount", "umount2", "pivot_root", "setns", "unshare",
      "fsopen", "fsmount", "move_mount", "open_tree", "fsconfig", "fspick", "mount_setattr", "keyctl", "add_key",
      "request_key", "bpf", "perf_event_open", "userfaultfd", "io_uring_setup", "io_uring_enter",
      "io_uring_register", "init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load",
      "open_by_handle_at", "sched_setaffinity"), errno.EPERM, None, ALL),
    # SysV and POSIX IPC: objects outlive the run (outside an IPC namespace), are seen by the other runs, and
    # hold host RAM outside RLIMIT_AS; special files (mkfifo, mknod) have no audit event
    (("shmget", "shmat", "shmdt", "shmctl", "msgget", "msgsnd", "msgrcv", "msgctl", "semget", "semop",
      "semtimedop", "semctl", "mq_open", "mq_unlink", "mq_timedsend", "mq_timedreceive", "mq_notify",
      "mq_getsetattr", "mknod", "mknodat"), errno.EPERM, None, ALL),
    # clone3 passes its flags in a struct seccomp cannot read: ENOSYS, and glibc falls back to clone (its
    # __clone_internal does so on ENOSYS), whose flags are checked here; openat2 likewise (its flags in a struct)
    (("clone3", "openat2"), errno.ENOSYS, None, ALL),
    *((("clone",), errno.EPERM, (0, flag), ALL) for flag in CLONE_REFUSED),
    # unlinked temporary files: disk no folder scan sees (Python's tempfile falls back to a named file)
    (("open",), errno.EPERM, (1, O_TMPFILE_BIT), ALL),
    (("openat",), errno.EPERM, (2, O_TMPFILE_BIT), ALL),
    # no namespace: sockets, sessions and process groups (the host kills the run's group whole), memfd, file
    # modes, owners, xattrs and times (landlock does not cover them)
    (("socket", "setsid", "setpgid", "memfd_create", "chmod", "fchmod", "fchmodat", "fchmodat2", "chown", "fchown",
      "lchown", "fchownat", "setxattr", "lsetxattr", "fsetxattr", "removexattr", "lremovexattr", "fremovexattr",
      "utime", "utimes", "utimensat", "futimesat"), errno.EPERM, None, BARE),
    # calls newer than the libseccomp of many hosts, by number (one number on every architecture from 424 on):
    # open_tree_attr (a mount), setxattrat and removexattrat (xattrs)
    ((467,), errno.EPERM, None, ALL),
    ((463, 466), errno.EPERM, None, BARE),
    # scheduling and limits of another process (the argument, a pid or `who`, is not 0)
    *(((name,), errno.EPERM, (arg, "other"), BARE) for name, arg in (
        ("setpriority", 1), ("sched_setscheduler", 0), ("sched_setparam", 0), ("sched_setattr", 0),
        ("prlimit64", 0), ("ioprio_set", 1))),
)

_libc = ctypes.CDLL(None, use_errno=True)
_syscall = getattr(_libc, "syscall", None)  # both absent off Linux (macOS has no prctl): abi() is then 0
_prctl = getattr(_libc, "prctl", None)
if _syscall is not None:
    _syscall.restype = ctypes.c_long
if _prctl is not None:
    _prctl.restype = ctypes.c_int
# looked up here, not in the child between fork and exec
_unshare, _mount, _capset = (getattr(_libc, n, None) for n in ("unshare", "mount", "capset"))


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def abi() -> int:
    """The kernel's landlock ABI version; 0 where landlock is missing or disabled (no lsm=landlock)."""
    if not sys.platform.startswith("linux") or _syscall is None or _prctl is None:
        return 0
    v = _syscall(_CREATE, None, ctypes.c_size_t(0), ctypes.c_uint32(_VERSION))
    return int(v) if v > 0 else 0


def refusal(version: int, root: bool) -> str | None:
    """Why this mode cannot hold here (one line), or None."""
    if version < 1:
        return ("this kernel has no landlock (Linux 5.13+ built with CONFIG_SECURITY_LANDLOCK and landlock in "
                "lsm=)")
    if version < 3:
        return f"landlock ABI {version} cannot stop truncating files outside (ABI 3, Linux 6.2+, needed)"
    if not root and version < SIGNAL_SCOPE_ABI:
        return (f"landlock ABI {version} cannot stop signals to the host's processes of the same user (ABI "
                f"{SIGNAL_SCOPE_ABI}, Linux 6.12+, needed when not run as root)")
    return None


def _handled_fs(version: int) -> int:
    return sum(bits for v, bits in _FS.items() if v <= version)


def _readable_by_others(path: str) -> bool:
    """Whether a uid with no relation to the owners can reach and read `path` (o+x on each folder above it)."""
    p = os.path.realpath(path)
    parts = p.strip("/").split("/")
    for i in range(len(parts)):
        try:
            st = os.stat("/" + "/".join(parts[:i]))
        except OSError:
            return False
        if not st.st_mode & stat.S_IXOTH:
            return False
    try:
        return bool(os.stat(p).st_mode & stat.S_IROTH)
    except OSError:
        return False


CLONE_NEWNS_IPC = CLONE_NEWNS | CLONE_NEWIPC
MS_REC, MS_PRIVATE, MS_NOSUID, MS_NODEV = 1 << 14, 1 << 18, 2, 4


class Confinement:
    """The kernel objects of one process the sandbox starts: its landlock ruleset (`private`, the run's folder,
    writable; None: nothing writable, the judge) and the uid and capability plan; `preexec` applies them in the
    child; `close` after the child has started. version 0: the uid and capability plan alone (guard-only).
    tmpfs_bytes (as root): the child first takes a mount and an IPC namespace of its own and mounts a tmpfs of
    that size on `private`, so the kernel caps what the run writes (unlinked files included) and its IPC
    objects die with it; the host's view of the folder stays empty."""

    def __init__(self, version: int, read_only: list[str], files: dict[str, int], private: str | None,
                 uid: int | None, seccomp: bytes, keep_read_cap: bool, tmpfs_bytes: int = 0):
        self.uid, self.keep_read_cap, self.ruleset, self.shared = uid, keep_read_cap, -1, False
        self._private = None if private is None else os.fsencode(private)
        self._tmpfs, self._private_rule, self._proc_rule = None, None, None
        if tmpfs_bytes and private is not None and uid is not None:
            self._tmpfs = f"size={int(tmpfs_bytes)},nr_inodes=65536,mode=0700,uid={uid},gid={uid}".encode()
        self._cap_hdr = _CapHeader(_CAP_V3, 0)
        keep = 1 << CAP_DAC_READ_SEARCH if keep_read_cap else 0
        self._caps = (_CapData * 2)(_CapData(keep, keep, keep), _CapData(0, 0, 0))
        self._prog = ctypes.create_string_buffer(seccomp, max(1, len(seccomp)))
        self._fprog = _SockFprog(len(seccomp) // 8, ctypes.cast(self._prog, ctypes.c_void_p))
        if version == 0:
            return
        handled = _handled_fs(version)
        attr = _RulesetAttr(handled, _NET_TCP if version >= 4 else 0, _SCOPES if version >= 6 else 0)
        size = 24 if version >= 6 else (16 if version >= 4 else 8)
        fd = _syscall(_CREATE, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
        if fd < 0:
            raise OSError(ctypes.get_errno(), "landlock_create_ruleset: " + os.strerror(ctypes.get_errno()))
        self.ruleset = int(fd)
        try:
            mine = handled & ~(MAKE_CHAR | MAKE_BLOCK | IOCTL_DEV)
            if private is not None:  # the program's own /proc/PID (read): known only in the child
                self._proc_rule = _PathBeneath(READ_FILE | READ_DIR, -1)
            if self._tmpfs is not None:  # the rule names the tmpfs's root: added in the child once it is mounted
                self._private_rule = _PathBeneath(mine, -1)
            rules = [(p, (EXECUTE | READ_FILE | READ_DIR)) for p in read_only] + list(files.items()) + (
                [] if private is None or self._tmpfs is not None else [(private, mine)])
            for path, access in rules:
                self._allow(path, access & handled)
        except BaseException:
            os.close(self.ruleset)
            raise

    def _allow(self, path: str, access: int) -> None:
        try:
            pfd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except OSError:
            return  # a path this system lacks (no /lib64): nothing to allow
        try:
            if not stat.S_ISDIR(os.fstat(pfd).st_mode):
                access &= FILE_ONLY
            rule = _PathBeneath(access, pfd)
            if _syscall(_ADD_RULE, ctypes.c_int(self.ruleset), ctypes.c_int(_PATH_BENEATH), ctypes.byref(rule),
                        ctypes.c_uint32(0)) != 0:
                raise OSError(ctypes.get_errno(), f"landlock_add_rule {path}: " + os.strerror(ctypes.get_errno()))
        finally:
            os.close(pfd)

    def preexec(self) -> None:
        """In the child, between fork and exec (after the rlimits): uid, capabilities, no_new_privs, landlock,
        seccomp. Any failure ends the child with status 125 before model code exists."""
        try:
            if self._tmpfs is not None:  # as root, before the uid drop: its own mounts and IPC
                _check(_unshare(CLONE_NEWNS_IPC))
                _check(_mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None))
                _check(_mount(b"tmpfs", self._private, b"tmpfs", MS_NOSUID | MS_NODEV, self._tmpfs))
                os.chdir(self._private)  # the cwd was set before this mount: it named the folder beneath
                if self.ruleset >= 0:
                    self._add_in_child(self._private, self._private_rule)
            if self.uid is not None:
                if self.keep_read_cap:  # the interpreter sits in a folder only root may enter (/root/.pyenv)
                    for cap in range(64):
                        if cap != CAP_DAC_READ_SEARCH:
                            _prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)
                    _check(_prctl(PR_SET_KEEPCAPS, 1, 0, 0, 0))
                os.setgroups([])
                os.setresgid(self.uid, self.uid, self.uid)
                os.setresuid(self.uid, self.uid, self.uid)
                if self.keep_read_cap:
                    _check(_capset(ctypes.byref(self._cap_hdr), self._caps))
                    _check(_prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_RAISE, CAP_DAC_READ_SEARCH, 0, 0))
            _check(_prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0))
            if self._proc_rule is not None:
                self._add_in_child(b"/proc/self", self._proc_rule)
            if self.ruleset >= 0:
                _check(_syscall(_RESTRICT, ctypes.c_int(self.ruleset), ctypes.c_uint32(0)))
            if self._fprog.len:
                _check(_prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(self._fprog), 0, 0))
        except BaseException:
            os._exit(125)

    def _add_in_child(self, path: bytes, rule: _PathBeneath) -> None:
        """Add a rule on `path` as the child sees it (its own tmpfs, its own /proc/PID)."""
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        rule.parent_fd = fd
        _check(_syscall(_ADD_RULE, ctypes.c_int(self.ruleset), ctypes.c_int(_PATH_BENEATH), ctypes.byref(rule),
                        ctypes.c_uint32(0)))
        os.close(fd)

    def close(self) -> None:
        if self.ruleset >= 0 and not self.shared:
            os.close(self.ruleset)


def _check(rc: int) -> None:
    if rc != 0:
        raise OSError(ctypes.get_errno(), "confinement")


_PROGS: dict[tuple, bytes | None] = {}
_LOCK = threading.Lock()


def bpf_program(which: str, arch: int = 0) -> bytes | None:
    """The BPF program (libseccomp through pyseccomp) of filter `which` ("bwrap", "bare", "judge"): the rows of
    SECCOMP_RULES that name it; syscalls of another architecture kill the process. arch: an AUDIT_ARCH value
    (pyseccomp.Arch) to build for another architecture (tests), 0 the native one. None without pyseccomp."""
    key = (which, arch)
    with _LOCK:
        if key not in _PROGS:
            try:
                import pyseccomp  # noqa: PLC0415 - optional (the sandbox extra)
            except (ImportError, OSError):
                _PROGS[key] = None
                return None
            f = pyseccomp.SyscallFilter(defaction=pyseccomp.ALLOW)
            foreign = False
            if arch:
                try:
                    f.add_arch(arch)
                    f.remove_arch(pyseccomp.Arch.NATIVE)
                    foreign = True
                except FileExistsError:  # arch is the native one
                    pass
            for names, err, test, filters in SECCOMP_RULES:
                if which not in filters:
                    continue
                args = ()
                if test is not None:
                    index, bits = test
                    args = (pyseccomp.Arg(index, pyseccomp.NE, 0),) if bits == "other" else (
                        pyseccomp.Arg(index, pyseccomp.MASKED_EQ, bits, bits),)
                for name in names:
                    if isinstance(name, str) and pyseccomp.resolve_syscall(arch, name) < 0:
                        continue  # a call this architecture lacks (aarch64 has no open, mknod, chmod...)
                    if isinstance(name, int) and foreign:
                        continue  # libseccomp reads a number as the native architecture's
                    f.add_rule(pyseccomp.ERRNO(err), name, *args)
            with tempfile.TemporaryFile() as fh:
                f.export_bpf(fh)
                fh.seek(0)
                _PROGS[key] = fh.read()
        return _PROGS[key]


def system_paths(prefixes: set[str], programs: str) -> tuple[list[str], dict[str, int]]:
    """(folders readable, files with their rights) for the candidate: the interpreter, system libraries, the
    sandbox's programs, a few devices."""
    folders = sorted({os.path.realpath(p) for p in ("/usr", "/lib", "/lib64", "/lib32", "/bin", "/sbin")
                      if os.path.exists(p)} | prefixes | {os.path.realpath(programs)})
    files = {"/etc/ld.so.cache": READ_FILE, "/etc/localtime": READ_FILE, "/dev/null": READ_FILE | WRITE_FILE,
             "/dev/zero": READ_FILE, "/dev/urandom": READ_FILE}
    return folders, files


def needs_read_cap(paths: list[str]) -> bool:
    """Whether the dropped uid needs CAP_DAC_READ_SEARCH to reach these (landlock still bounds what it reads)."""
    return not all(_readable_by_others(p) for p in paths)
