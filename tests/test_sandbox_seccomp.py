"""The seccomp filter (sandbox_landlock.SECCOMP_RULES, one definition for every process the sandbox starts), syscall
by syscall, on x86_64 and aarch64 numbers: the BPF program libseccomp exports for each architecture is run here by
a small classic-BPF interpreter over seccomp_data, so both architectures are checked on either machine; then the
native program is checked inside the sandbox (bwrap and landlock): the refused calls fail, threads and forks work."""

from __future__ import annotations

import errno
import struct

import pyseccomp
import pytest

from mechdiag import sandbox
from mechdiag import sandbox_landlock as landlock

# kernel syscall numbers (arch/x86/entry/syscalls/syscall_64.tbl; include/uapi/asm-generic/unistd.h for aarch64),
# None where the architecture lacks the call
NUMBERS = {
    "ptrace": (101, 117), "process_vm_readv": (310, 270), "process_vm_writev": (311, 271), "mount": (165, 40),
    "umount2": (166, 39), "pivot_root": (155, 41), "setns": (308, 268), "unshare": (272, 97), "fsopen": (430, 430),
    "fsmount": (432, 432), "move_mount": (429, 429), "open_tree": (428, 428), "fsconfig": (431, 431),
    "fspick": (433, 433), "mount_setattr": (442, 442), "keyctl": (250, 219), "add_key": (248, 217),
    "request_key": (249, 218), "bpf": (321, 280), "perf_event_open": (298, 241), "userfaultfd": (323, 282),
    "io_uring_setup": (425, 425), "io_uring_enter": (426, 426), "io_uring_register": (427, 427),
    "init_module": (175, 105), "finit_module": (313, 273), "delete_module": (176, 106), "kexec_load": (246, 104),
    "kexec_file_load": (320, 294), "open_by_handle_at": (304, 265), "sched_setaffinity": (203, 122),
    "shmget": (29, 194), "shmat": (30, 196), "shmdt": (67, 197), "shmctl": (31, 195), "msgget": (68, 186),
    "msgsnd": (69, 189), "msgrcv": (70, 188), "msgctl": (71, 187), "semget": (64, 190), "semop": (65, 193),
    "semtimedop": (220, 192), "semctl": (66, 191), "mq_open": (240, 180), "mq_unlink": (241, 181),
    "mq_timedsend": (242, 182), "mq_timedreceive": (243, 183), "mq_notify": (244, 184),
    "mq_getsetattr": (245, 185), "mknod": (133, None), "mknodat": (259, 33), "clone3": (435, 435),
    "openat2": (437, 437), "clone": (56, 220), "open": (2, None), "openat": (257, 56), "socket": (41, 198),
    "setsid": (112, 157), "setpgid": (109, 154), "memfd_create": (319, 279), "chmod": (90, None),
    "fchmod": (91, 52), "fchmodat": (268, 53), "fchmodat2": (452, 452), "chown": (92, None), "fchown": (93, 55),
    "lchown": (94, None), "fchownat": (260, 54), "setxattr": (188, 5), "lsetxattr": (189, 6),
    "fsetxattr": (190, 7), "removexattr": (197, 14), "lremovexattr": (198, 15), "fremovexattr": (199, 16),
    "utime": (132, None), "utimes": (235, None), "utimensat": (280, 88), "futimesat": (261, None),
    "setpriority": (141, 140), "sched_setscheduler": (144, 119), "sched_setparam": (142, 118),
    "sched_setattr": (314, 274), "prlimit64": (302, 261), "ioprio_set": (251, 30), "getpid": (39, 172),
    "open_tree_attr": (467, 467), "setxattrat": (463, 463), "removexattrat": (466, 466),
    "read": (0, 63), "write": (1, 64), "futex": (202, 98), "wait4": (61, 260),
}
ARCHES = (("x86_64", pyseccomp.Arch.X86_64, 0), ("aarch64", pyseccomp.Arch.AARCH64, 1))
ALLOW, KILL_THREAD, KILL_PROCESS = 0x7FFF0000, 0, 0x80000000
O_RDWR, O_CLOEXEC = 2, 0o2000000
O_DIRECTORY = {"x86_64": 0o200000, "aarch64": 0o40000}
O_TMPFILE = {a: landlock.O_TMPFILE_BIT | d for a, d in O_DIRECTORY.items()}
THREAD = 0x3D0F00  # CLONE_VM|FS|FILES|SIGHAND|THREAD|SYSVSEM|SETTLS|PARENT_SETTID|CHILD_CLEARTID (pthread_create)
FORK = 0x01200011  # CLONE_CHILD_SETTID|CLONE_CHILD_CLEARTID|SIGCHLD (glibc's fork)


def ERRNO(e: int) -> int:
    return 0x00050000 | e


ALU = {0x00: lambda a, b: a + b, 0x10: lambda a, b: a - b, 0x20: lambda a, b: a * b, 0x40: lambda a, b: a | b,
       0x50: lambda a, b: a & b, 0x60: lambda a, b: a << b, 0x70: lambda a, b: a >> b, 0x80: lambda a, b: -a,
       0xA0: lambda a, b: a ^ b}


def run_bpf(prog: bytes, nr: int, arch: int, args=(0, 0, 0, 0, 0, 0)) -> int:
    """The action a classic-BPF seccomp program returns for one syscall (struct seccomp_data, little-endian)."""
    data = struct.pack("<iIQ6Q", nr, arch, 0, *[a & 0xFFFFFFFFFFFFFFFF for a in args])
    insns = [struct.unpack_from("<HBBI", prog, i) for i in range(0, len(prog), 8)]
    a = x = 0
    mem = [0] * 16
    pc = 0
    while True:
        code, jt, jf, k = insns[pc]
        pc += 1
        cls, mode, op, src = code & 7, code & 0xE0, code & 0xF0, (x if code & 8 else k)
        if cls == 0:  # LD
            a = struct.unpack_from("<I", data, k)[0] if mode == 0x20 else (mem[k] if mode == 0x60 else
                                                                           (len(data) if mode == 0x80 else k))
        elif cls == 1:  # LDX
            x = mem[k] if mode == 0x60 else (len(data) if mode == 0x80 else k)
        elif cls == 2:
            mem[k] = a
        elif cls == 3:
            mem[k] = x
        elif cls == 4:  # ALU
            a = ALU[op](a, src) & 0xFFFFFFFF
        elif cls == 5:  # JMP
            if op == 0x00:
                pc += k
                continue
            hit = {0x10: a == src, 0x20: a > src, 0x30: a >= src, 0x40: bool(a & src)}[op]
            pc += jt if hit else jf
        elif cls == 6:  # RET
            return k if mode == 0 else a
        else:  # MISC: TAX / TXA
            if op == 0:
                x = a
            else:
                a = x


NATIVE = "x86_64" if pyseccomp.resolve_syscall(pyseccomp.Arch.NATIVE, "open") == 2 else "aarch64"


def _expected(which: str, name: str, args, arch_name: str) -> int:
    """What SECCOMP_RULES says of one call, read from the table (not from the filter). Rows by number (calls newer
    than libseccomp) exist in the native program only: libseccomp reads a number as the native one's."""
    for names, err, test, filters in landlock.SECCOMP_RULES:
        nums = [n for n in names if isinstance(n, int)] if arch_name == NATIVE else []
        if which not in filters or not (name in names or NUMBERS[name][0] in nums):
            continue
        if test is None:
            return ERRNO(err)
        index, bits = test
        if (bits == "other" and args[index] != 0) or (bits != "other" and args[index] & bits == bits):
            return ERRNO(err)
    return ALLOW


@pytest.mark.parametrize("arch_name,arch,col", ARCHES)
def test_every_rule_syscall_by_syscall_on_both_architectures(arch_name, arch, col):
    # libseccomp resolves each name to the kernel's number; the exported program answers each call as the table
    # says, with its arguments: clone with each refused flag (and not with pthread's or fork's), open/openat with
    # O_TMPFILE (not a plain open), the scheduling calls aimed at another process (not at itself)
    for name, nums in NUMBERS.items():
        got = pyseccomp.resolve_syscall(arch, name)
        assert (got if got >= 0 else None) == nums[col] or nums[col] in (463, 466, 467), (arch_name, name, got)
    calls = [(n, (0,) * 6) for n in NUMBERS]
    calls += [("clone", (f, 0, 0, 0, 0, 0)) for f in (*landlock.CLONE_REFUSED, THREAD, FORK,
                                                      FORK | landlock.CLONE_NEWUSER, THREAD | landlock.CLONE_PARENT)]
    calls += [("openat", (-100, 0, O_TMPFILE[arch_name] | O_RDWR, 0, 0, 0)),
              ("openat", (-100, 0, O_CLOEXEC, 0, 0, 0)), ("open", (0, O_TMPFILE[arch_name] | O_RDWR, 0, 0, 0, 0)),
              ("open", (0, O_RDWR | O_CLOEXEC, 0, 0, 0, 0))]
    calls += [(n, a) for n in ("setpriority", "prlimit64", "sched_setparam") for a in ((0,) * 6, (1, 4242, 0, 0, 0, 0),
                                                                                   (4242, 1, 0, 0, 0, 0))]
    seen = {"refused": 0, "allowed": 0}
    for which in ("bwrap", "bare", "judge"):
        prog = landlock.bpf_program(which, arch)
        assert prog is not None
        for name, args in calls:
            nr = NUMBERS[name][col]
            if nr is None:
                continue
            want = _expected(which, name, args, arch_name)
            assert run_bpf(prog, nr, arch, args) == want, (arch_name, which, name, [hex(a) for a in args])
            seen["refused" if want != ALLOW else "allowed"] += 1
        # another architecture's call kills (libseccomp's default for a foreign architecture: SECCOMP_RET_KILL)
        other = ARCHES[1 - col][1]
        assert run_bpf(prog, NUMBERS["getpid"][1 - col], other) in (KILL_THREAD, KILL_PROCESS)
    # the table itself, spelled out for the classes the sandbox depends on
    for which in ("bwrap", "bare", "judge"):
        for name in ("fsopen", "fsmount", "move_mount", "open_tree", "fsconfig", "fspick", "mount_setattr",
                     "shmget", "msgget", "mq_open", "semget", "unshare", "setns", "mknodat"):
            assert _expected(which, name, (0,) * 6, arch_name) == ERRNO(errno.EPERM), (which, name)
        assert _expected(which, "clone3", (0,) * 6, arch_name) == ERRNO(errno.ENOSYS)
        for flag in landlock.CLONE_REFUSED:
            assert _expected(which, "clone", (flag | FORK,) + (0,) * 5, arch_name) == ERRNO(errno.EPERM)
        assert _expected(which, "clone", (THREAD,) + (0,) * 5, arch_name) == ALLOW
    assert seen["refused"] > 200 and seen["allowed"] > 50, seen


SYSCALLS = """
import ctypes, os, threading
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
def call(nr, *args):
    ctypes.set_errno(0)
    r = libc.syscall(nr, *[ctypes.c_long(a) for a in args])
    return (r, ctypes.get_errno())
def f(calls, clone_nr, flags_list):
    out = {name: call(nr) for name, nr in calls.items()}
    # clone with a refused flag: refused before any child exists (a child would return 0 here and exit)
    for flags in flags_list:
        r = call(clone_nr, flags | 17, 0, 0, 0, 0)
        if r[0] == 0:
            os._exit(0)
        out['clone %x' % flags] = r
    box = []
    t = threading.Thread(target=lambda: box.append(1))
    t.start()
    t.join()
    pid = os.fork()
    if pid == 0:
        os._exit(7)
    out['thread'] = box
    out['fork'] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    return out
"""


def test_native_filter_refuses_inside_each_mode():
    # guard off: the kernel answers. Each refused call of the ALL rows fails with its errno (clone3 ENOSYS, so
    # glibc falls back to clone); clone with each namespace flag or CLONE_PARENT fails EPERM; a thread and a fork
    # (through the fallback) still work
    col = 0 if NATIVE == "x86_64" else 1
    names = ["unshare", "setns", "fsopen", "fsmount", "move_mount", "open_tree", "fsconfig", "fspick",
             "mount_setattr", "shmget", "msgget", "semget", "mq_open", "clone3", "keyctl", "open_tree_attr"]
    calls = {n: NUMBERS[n][col] for n in names}
    want = {n: (-1, errno.ENOSYS if n == "clone3" else errno.EPERM) for n in names}
    flags = list(landlock.CLONE_REFUSED)
    want.update({f"clone {fl:x}": (-1, errno.EPERM) for fl in flags})
    want.update({"thread": [1], "fork": 7})
    tests = f"out = f({calls!r}, {NUMBERS['clone'][col]}, {flags!r})\nprint(out)\nassert out == {want!r}\n"
    for iso in ("bwrap", "landlock"):
        r = sandbox._run(SYSCALLS, tests, 5, 256, 16, 8, sandbox.MAX_OUTPUT, 20, (), iso, guard=False)
        assert r.passed and r.isolation == iso, (iso, r)
