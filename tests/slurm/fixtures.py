"""pytest fixture `slurm_cluster`: one real two-node Slurm cluster for the whole test session.

Skips when this machine cannot host it (not root, tools missing, packages not installable);
with REQUIRE_SLURM=1 in the environment it fails instead, so CI cannot silently skip it."""
import os
import shutil

import pytest

from .cluster import PackageInstallError, SlurmCluster


def unavailable_reason():
    """Why this machine cannot run the test cluster, or None if it can."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, /etc/hosts, apt-get)"
    missing = [tool for tool in ("unshare", "nsenter", "ip") if not shutil.which(tool)]
    if missing:
        return f"missing tools: {', '.join(missing)}"
    return None


def skip_or_fail(reason):
    if os.environ.get("REQUIRE_SLURM") == "1":
        pytest.fail(f"REQUIRE_SLURM=1 but the Slurm test cluster is unavailable: {reason}")
    pytest.skip(f"Slurm test cluster unavailable: {reason}")


@pytest.fixture(scope="session")
def slurm_cluster():
    reason = unavailable_reason()
    if reason:
        skip_or_fail(reason)
    cluster = SlurmCluster()
    try:
        cluster.start()
    except PackageInstallError as e:
        skip_or_fail(str(e))
    try:
        yield cluster
    finally:
        cluster.close()
