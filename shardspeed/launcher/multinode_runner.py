"""DeepSpeed's multi-node backends (``deepspeed.launcher.multinode_runner``).

Each backend turns DeepSpeed's runner namespace (:func:`shardspeed.launcher.runner.parse_args`)
and the selected resources into the one command that starts the whole job:

* :class:`PDSHRunner`: ``pdsh`` runs :mod:`shardspeed.launcher.launch` on every host (node
  rank from pdsh's ``%n``), which starts that host's ranks with torchrun;
* :class:`OpenMPIRunner`, :class:`MPICHRunner`, :class:`IMPIRunner`, :class:`MVAPICHRunner`:
  ``mpirun`` starts every rank; ShardSpeed's ``init_distributed`` reads the rank from the
  MPI environment (``OMPI_COMM_WORLD_*``, ``PMI_*``), so the script runs directly;
* :class:`SlurmRunner`: ``srun -n <ranks>``; ranks come from ``SLURM_PROCID``.

``get_cmd`` only builds the command (``MVAPICHRunner`` also writes its host list file);
nothing here starts a process.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
import warnings
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any

from shardspeed.launcher.constants import MVAPICH_TMP_HOSTFILE, PDSH_MAX_FAN_OUT
from shardspeed.utils.logging import get_logger

logger = get_logger(__name__)

LAUNCH_MODULE = "shardspeed.launcher.launch"
# characters an exported value may hold without quotes
_PLAIN_VALUE = re.compile(r"^[\w@%+=:,./-]*$")

ActiveResources = Mapping[str, Sequence[int]]


class MultiNodeRunner(ABC):
    """One way of starting a job on several hosts."""

    def __init__(self, args: argparse.Namespace, world_info_base64: str) -> None:
        self.args = args
        self.validate_args()
        self.user_arguments: list[str] = self.parse_user_args()
        self.user_script: str = args.user_script
        self.world_info_base64 = world_info_base64
        self.exports: dict[str, str] = {}

    @abstractmethod
    def backend_exists(self) -> Any:
        """Whether the backend's tool is installed (truthy: its path, or True)."""

    @abstractmethod
    def get_cmd(self, environment: dict[str, str], active_resources: ActiveResources) -> Any:
        """The command that starts the job."""

    def add_export(self, key: str, var: str) -> None:
        """Export ``key=var`` to every rank (``var`` double-quoted if it has odd characters)."""
        value = var.strip()
        if not _PLAIN_VALUE.match(value):
            value = f'"{value}"'
        self.exports[key.strip()] = value

    def parse_user_args(self) -> list[str]:
        return list(self.args.user_args)

    @property
    def name(self) -> str:
        """The backend's ``--launcher`` name."""
        return type(self).__name__

    def validate_args(self) -> None:  # noqa: B027 - optional hook, no-op by default
        """Refuse runner flags the backend cannot honour (``ValueError``)."""

    @classmethod  # noqa: B027 - optional hook, no-op by default
    def validate_active_resources(cls, active_resources: ActiveResources) -> None:
        """Refuse a resource selection the backend cannot express (``ValueError``)."""

    def _python(self) -> list[str]:
        """``python -u [-m]`` before the script, nothing with ``--no_python``."""
        if self.args.no_python:
            return []
        return [sys.executable, "-u", *(["-m"] if self.args.module else [])]


class PDSHRunner(MultiNodeRunner):
    """``pdsh`` over ssh: every host runs :mod:`shardspeed.launcher.launch` for its ranks."""

    def backend_exists(self) -> str | None:
        return shutil.which("pdsh")

    @property
    def name(self) -> str:
        return "pdsh"

    def parse_user_args(self) -> list[str]:
        # pdsh re-splits the remote line on whitespace: keep an argument with spaces whole
        quoted = []
        for arg in self.args.user_args:
            if " " in arg:
                escaped = arg.replace('"', '\\"')
                arg = f'"{escaped}"'
            quoted.append(arg)
        return quoted

    def get_cmd(
        self, environment: dict[str, str], active_resources: ActiveResources
    ) -> tuple[list[str], list[str], dict[str, str]]:
        """``(pdsh command, pdsh command that kills the launchers, environment)``."""
        environment["PDSH_RCMD_TYPE"] = "ssh"
        if self.args.ssh_port is not None:
            previous = environment.get("PDSH_SSH_ARGS_APPEND", "")
            environment["PDSH_SSH_ARGS_APPEND"] = f"{previous} -p {self.args.ssh_port}"
        workers = ",".join(active_resources)
        logger.info("running on the following workers: %s", workers)
        pdsh = ["pdsh", "-S", "-f", str(PDSH_MAX_FAN_OUT), "-w", workers]
        pdsh += shlex.split(self.args.launcher_args)

        exports = "".join(f"export {key}={value}; " for key, value in self.exports.items())
        launcher = [sys.executable, "-u", "-m", LAUNCH_MODULE]
        remote = [
            exports,
            f"cd {os.path.abspath('.')};",
            *launcher,
            f"--world_info={self.world_info_base64}",
            "--node_rank=%n",  # pdsh puts the host's index in the -w list here
            f"--master_addr={self.args.master_addr}",
            f"--master_port={self.args.master_port}",
        ]
        if self.args.venv_script is not None:
            remote.insert(0, f"source {self.args.venv_script};")
        flags = [
            ("--no_python", self.args.no_python),
            ("--module", self.args.module),
            ("--no_local_rank", self.args.no_local_rank),
        ]
        remote += [flag for flag, on in flags if on]
        if self.args.save_pid:
            remote += ["--save_pid", str(os.getpid())]
        if self.args.enable_each_rank_log:
            remote.append(f"--enable_each_rank_log={self.args.enable_each_rank_log}")

        # pkill pattern: the launcher's argv with escaped spaces
        kill = [*pdsh, "pkill -f ", "\\ ".join(launcher)]
        return [*pdsh, *remote, self.user_script, *self.user_arguments], kill, environment


class _MPIRunner(MultiNodeRunner):
    """A backend where ``mpirun`` starts each rank: whole hosts only, from the hostfile."""

    def __init__(
        self, args: argparse.Namespace, world_info_base64: str, resource_pool: Mapping[str, int]
    ) -> None:
        super().__init__(args, world_info_base64)
        self.resource_pool = dict(resource_pool)

    def validate_args(self) -> None:
        if self.args.include != "" or self.args.exclude != "":
            raise ValueError(
                f"--launcher {self.name} does not support --include/--exclude "
                f"(got {self.args.include!r}/{self.args.exclude!r}); list only the hosts to "
                "use in the hostfile, or use --launcher pdsh."
            )
        if self.args.num_nodes != -1 or self.args.num_gpus != -1:
            raise ValueError(
                f"--launcher {self.name} does not support --num_nodes/--num_gpus (got "
                f"{self.args.num_nodes}/{self.args.num_gpus}); set the hosts and slots in the "
                "hostfile, or use --launcher pdsh."
            )

    def _uniform_slots(self, label: str) -> tuple[int, int]:
        """``(total ranks, ranks per host)``; every host must have the same slot count."""
        counts = list(self.resource_pool.values())
        if len(set(counts)) > 1:
            raise ValueError(
                f"{label} needs the same number of slots on every host, got "
                f"{self.resource_pool}; make the hostfile's slots= equal."
            )
        return sum(counts), counts[0]


class OpenMPIRunner(_MPIRunner):
    """Open MPI's ``mpirun`` with the hostfile."""

    def __init__(
        self, args: argparse.Namespace, world_info_base64: str, resource_pool: Mapping[str, int]
    ) -> None:
        super().__init__(args, world_info_base64, resource_pool)
        self.add_export("UCX_TLS", "tcp")

    def backend_exists(self) -> str | None:
        return shutil.which("ompi_info")

    @property
    def name(self) -> str:
        return "openmpi"

    def get_cmd(self, environment: dict[str, str], active_resources: ActiveResources) -> list[str]:
        total = sum(self.resource_pool.values())
        extra = shlex.split(self.args.launcher_args)
        # default TCP interface unless the user picked one with --mca btl_tcp_if_include
        picks_interface = any(
            extra[i] in ("-mca", "--mca") and extra[i + 1] == "btl_tcp_if_include"
            for i in range(len(extra) - 1)
        )
        interface = [] if picks_interface else ["--mca", "btl_tcp_if_include", "eth0"]
        mpirun = ["mpirun", "-n", str(total), "-hostfile", str(self.args.hostfile)]
        mpirun += ["--mca", "btl", "^openib", *interface, *extra]
        for key, value in self.exports.items():
            mpirun += ["-x", f"{key}={value}"]
        return [*mpirun, *self._python(), self.user_script, *self.user_arguments]


class MPICHRunner(_MPIRunner):
    """MPICH's ``mpirun`` (Hydra): ``-ppn`` ranks on each host of ``-hosts``."""

    def backend_exists(self) -> str | None:
        return shutil.which("mpirun")

    @property
    def name(self) -> str:
        return "mpich"

    def get_cmd(self, environment: dict[str, str], active_resources: ActiveResources) -> list[str]:
        total, per_host = self._uniform_slots("MPICH")
        cmd = ["mpirun", "-n", str(total), "-ppn", str(per_host)]
        cmd += shlex.split(self.args.launcher_args)
        for key, value in self.exports.items():
            cmd += ["-genv", f"{key}={value}"]
        cmd += ["-genv", "MASTER_ADDR", str(self.args.master_addr)]
        cmd += ["-genv", "MASTER_PORT", str(self.args.master_port)]
        cmd += ["-genv", "WORLD_SIZE", str(total), "-genv", "LOCAL_SIZE", str(per_host)]
        cmd += ["-hosts", ",".join(self.resource_pool)]
        return [*cmd, *self._python(), self.user_script, *self.user_arguments]


class IMPIRunner(_MPIRunner):
    """Intel MPI's ``mpirun``: one ``-n 1`` section per rank with its RANK and LOCAL_RANK."""

    def backend_exists(self) -> str | None:
        return shutil.which("mpirun")

    @property
    def name(self) -> str:
        return "impi"

    def validate_args(self) -> None:
        super().validate_args()
        if getattr(self.args, "bind_cores_to_rank", False):
            raise ValueError(
                "--launcher impi with --bind_cores_to_rank is not supported by ShardSpeed; "
                "drop --bind_cores_to_rank (pin threads with OMP_NUM_THREADS instead)."
            )

    def get_cmd(self, environment: dict[str, str], active_resources: ActiveResources) -> list[str]:
        total, per_host = self._uniform_slots("Intel MPI")
        cmd = ["mpirun", "-ppn", str(per_host), *shlex.split(self.args.launcher_args)]
        for key, value in self.exports.items():
            cmd += ["-genv", key, value]
        cmd += ["-genv", "MASTER_ADDR", str(self.args.master_addr)]
        cmd += ["-genv", "MASTER_PORT", str(self.args.master_port)]
        cmd += ["-genv", "WORLD_SIZE", str(total), "-genv", "LOCAL_SIZE", str(per_host)]
        cmd += ["-genv", "I_MPI_PIN", "0"]  # no MPI core pinning
        cmd += ["-hosts", ",".join(self.resource_pool)]
        for rank in range(total):
            section = ["-n", "1", "-env", "RANK", str(rank), "-env", "LOCAL_RANK"]
            section += [str(rank % per_host), *self._python(), self.user_script]
            cmd += ([":"] if rank else []) + section + self.user_arguments
        return cmd


class SlurmRunner(MultiNodeRunner):
    """Slurm's ``srun -n <ranks>`` (ranks placed by count, whole hosts only)."""

    def __init__(
        self, args: argparse.Namespace, world_info_base64: str, resource_pool: Mapping[str, int]
    ) -> None:
        super().__init__(args, world_info_base64)
        self.resource_pool = dict(resource_pool)

    def backend_exists(self) -> str | None:
        return shutil.which("sinfo")

    @property
    def name(self) -> str:
        return "slurm"

    @classmethod
    def validate_active_resources(cls, active_resources: ActiveResources) -> None:
        """srun places tasks by count: every host must keep slots ``0..n-1``, same ``n``."""
        for host, slots in active_resources.items():
            if list(slots) != list(range(len(slots))):
                raise ValueError(
                    f"--launcher slurm cannot select device ids, got {list(slots)} on {host}; "
                    "filter whole hosts, or keep the first N slots on every host."
                )
        counts = {host: len(slots) for host, slots in active_resources.items()}
        if len(set(counts.values())) > 1:
            raise ValueError(
                f"--launcher slurm needs the same slot count on every host, got {counts}; "
                "select the same number of slots on each host."
            )

    def get_cmd(self, environment: dict[str, str], active_resources: ActiveResources) -> list[str]:
        self.validate_active_resources(active_resources)
        total = sum(len(slots) for slots in active_resources.values())
        cmd = ["srun", "-n", str(total), *shlex.split(self.args.launcher_args)]
        comment = getattr(self.args, "slurm_comment", "")
        if comment:
            cmd += ["--comment", comment]
        if self.args.include != "" or self.args.exclude != "":
            # name the hosts left after filtering; --nodes makes srun use all of them
            cmd += ["--nodelist", ",".join(active_resources), "--nodes", str(len(active_resources))]
        if self.args.num_nodes > 0:
            cmd += ["--nodes", str(self.args.num_nodes)]
        if self.args.num_gpus > 0:
            cmd += ["--gpus-per-node", str(self.args.num_gpus)]
        exports = "--export=ALL" + "".join(f",{k}={v}" for k, v in self.exports.items())
        return [*cmd, exports, sys.executable, "-u", self.user_script, *self.user_arguments]


class MVAPICHRunner(_MPIRunner):
    """MVAPICH2-GDR's ``mpirun`` with a host list file and its tuning variables."""

    def __init__(
        self, args: argparse.Namespace, world_info_base64: str, resource_pool: Mapping[str, int]
    ) -> None:
        super().__init__(args, world_info_base64, resource_pool)
        from shardspeed.accelerator import get_accelerator

        self.add_export("MV2_SMP_USE_CMA", "0")  # CMA is missing on Ubuntu kernels
        self.add_export("MV2_DEBUG_SHOW_BACKTRACE", "1")
        if get_accelerator().device_name() == "cuda":
            self.add_export("MV2_USE_CUDA", "1")  # CUDA-aware MPI
        self.add_export("MV2_SUPPORT_DL", "1")
        self.add_export("MV2_ENABLE_AFFINITY", "0")  # allows MPI_THREAD_MULTIPLE
        self.add_export("MV2_INTER_ALLGATHER_TUNING", "5")
        self.add_export("MV2_CUDA_USE_NAIVE", "0")

    def backend_exists(self) -> bool:
        if not shutil.which("mpiname"):
            warnings.warn("mpiname not found: MVAPICH is not installed properly", stacklevel=2)
            return False
        flavour = subprocess.check_output(["mpiname"]).decode("utf-8").strip()
        if "MVAPICH2-GDR" not in flavour:
            warnings.warn(f"mpiname reports {flavour!r}, expected MVAPICH2-GDR", stacklevel=2)
            return False
        return True

    @property
    def name(self) -> str:
        return "mvapich"

    def get_cmd(self, environment: dict[str, str], active_resources: ActiveResources) -> list[str]:
        total, per_host = self._uniform_slots("mvapich")
        with open(MVAPICH_TMP_HOSTFILE, "w", encoding="utf-8") as handle:
            handle.writelines(f"{host}\n" for host in self.resource_pool)
        cmd = ["mpirun", "-np", str(total), "-ppn", str(per_host)]
        cmd += ["--hostfile", MVAPICH_TMP_HOSTFILE, *shlex.split(self.args.launcher_args)]
        for key, value in self.exports.items():
            cmd += ["-env", f"{key}={value}"]
        return [*cmd, *self._python(), self.user_script, *self.user_arguments]
