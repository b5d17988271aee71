"""ddprun's launcher flags as torchrun reads them, checked through --dry-run's resolved
configuration: the static backend's endpoint, IPv6 master addresses, Slurm's defaults against
explicit flags, the local-ranks filter, --rdzv-conf's spellings, CUDA_VISIBLE_DEVICES, short
options with attached values."""
import os
import subprocess

import pytest

# Variables of the environment the tests run in that would change the resolved configuration.
_OUTSIDE = ("SLURM_", "PET_", "CUDA_VISIBLE_DEVICES", "DDPRUN_SLURM")


def dry_run(ddprun, args, env=None, program="x.conf"):
    base = {k: v for k, v in os.environ.items() if not k.startswith(_OUTSIDE)}
    base.update(env or {})
    r = subprocess.run([ddprun, "--dry-run"] + args + [program], capture_output=True, text=True,
                       timeout=10, env=base)
    conf = dict(line.split(": ", 1) for line in r.stdout.splitlines() if ": " in line)
    return r, conf


def test_static_backend_takes_the_rdzv_endpoint_when_given(ddprun):
    r, conf = dry_run(ddprun, ["--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint",
                               "10.1.2.3:29501"])
    assert r.returncode == 0, r.stderr
    assert conf["rdzv_backend"] == "static"
    assert conf["rdzv_endpoint"] == "10.1.2.3:29501", "torchrun: --rdzv-endpoint wins"
    # without it, or with an empty one, MASTER_ADDR:MASTER_PORT as before
    for extra in ([], ["--rdzv-endpoint", ""]):
        r, conf = dry_run(ddprun, ["--nnodes", "2", "--master-addr", "10.9.9.9", "--master-port",
                                   "1234"] + extra)
        assert r.returncode == 0, r.stderr
        assert conf["rdzv_endpoint"] == "10.9.9.9:1234", extra
    r, _ = dry_run(ddprun, ["--nnodes", "2", "--rdzv-endpoint", "10.1.2.3"])
    assert r.returncode == 2 and "static backend needs HOST:PORT" in r.stderr, r.stderr


def test_master_addr_in_brackets_is_an_ipv6_address(ddprun):
    r, conf = dry_run(ddprun, ["--master-addr", "[::1]", "--master-port", "29511"])
    assert r.returncode == 0, r.stderr
    assert conf["master"] == "::1:29511"
    assert conf["rdzv_endpoint"] == "::1:29511"
    r, _ = dry_run(ddprun, ["--master-addr", "[]"])
    assert r.returncode == 2 and "--master-addr" in r.stderr, r.stderr


SLURM = {"SLURM_JOB_ID": "12345", "SLURM_NNODES": "2", "SLURM_NODEID": "1",
         "SLURM_JOB_NODELIST": "gpu[01-02]", "PATH": "/nonexistent:/usr/bin:/bin"}


def test_slurm_defaults_give_way_to_an_explicit_master(ddprun):
    r, conf = dry_run(ddprun, [], env=SLURM)
    assert r.returncode == 0, r.stderr
    assert conf["rdzv_backend"] == "c10d" and conf["rdzv_endpoint"] == "gpu01:29745"
    r, conf = dry_run(ddprun, ["--master-addr", "head", "--master-port", "4000"], env=SLURM)
    assert r.returncode == 0, r.stderr
    assert conf["rdzv_backend"] == "static", "torchrun's default backend at the given master"
    assert conf["rdzv_endpoint"] == "head:4000" and conf["master"] == "head:4000"
    assert conf["nnodes"] == "2:2" and conf["node_rank"] == "1", "the rest of Slurm's stays"
    r, conf = dry_run(ddprun, [], env=dict(SLURM, PET_MASTER_PORT="4001"))
    assert conf["rdzv_backend"] == "static" and conf["rdzv_endpoint"] == "gpu01:4001"
    # an explicit rendezvous beats both
    r, conf = dry_run(ddprun, ["--master-addr", "head", "--rdzv-endpoint", "other:5000"],
                      env=SLURM)
    assert conf["rdzv_backend"] == "c10d" and conf["rdzv_endpoint"] == "other:5000"
    r, conf = dry_run(ddprun, ["--master-addr", "head", "--rdzv-backend", "c10d"], env=SLURM)
    assert conf["rdzv_backend"] == "c10d" and conf["rdzv_endpoint"] == "gpu01:29745"


def test_standalone_names_only_the_endpoint_it_was_given(ddprun):
    r, _ = dry_run(ddprun, ["--standalone"], env=SLURM)
    assert r.returncode == 0, r.stderr
    assert "ignores --rdzv-endpoint" not in r.stderr, "Slurm's endpoint was not the user's"
    r, _ = dry_run(ddprun, ["--standalone", "--rdzv-endpoint", "h:1"])
    assert "--standalone ignores --rdzv-endpoint h:1\n" in r.stderr, r.stderr


def test_an_empty_local_ranks_filter_shows_every_rank(ddprun):
    r, conf = dry_run(ddprun, ["--nproc-per-node", "3", "--local-ranks-filter", ""])
    assert r.returncode == 0, r.stderr
    assert conf["local_ranks_shown"] == "0 1 2"
    r, conf = dry_run(ddprun, ["--nproc-per-node", "3"], env={"PET_LOCAL_RANKS_FILTER": ""})
    assert conf["local_ranks_shown"] == "0 1 2"
    r, conf = dry_run(ddprun, ["--nproc-per-node", "3", "--local-ranks-filter", "1"])
    assert conf["local_ranks_shown"] == "1"


def test_rdzv_conf_as_torch_spells_it(ddprun):
    r, conf = dry_run(ddprun, ["--rdzv-conf", " join_timeout = 900, read_timeout=300 ,"])
    assert r.returncode == 0, r.stderr
    assert "join_timeout=900," in conf["rdzv_conf"] and "read_timeout=300," in conf["rdzv_conf"]
    # heartbeat = interval x attempts, whichever comes first
    for spec in ("keep_alive_interval=4,keep_alive_max_attempt=5",
                 "keep_alive_max_attempt=5, keep_alive_interval=4"):
        r, conf = dry_run(ddprun, ["--rdzv-conf", spec])
        assert r.returncode == 0, r.stderr
        assert "heartbeat_timeout=20,keep_alive_interval=4," in conf["rdzv_conf"], spec
    r, _ = dry_run(ddprun, ["--rdzv-conf", "heartbeat_timeout=9,keep_alive_max_attempt=2"])
    assert r.returncode == 2 and "give one" in r.stderr, r.stderr
    for value, want in (("TRUE", "true"), ("yes", "true"), ("Y", "true"), ("1", "true"),
                        ("False", "false"), ("no", "false"), ("0", "false"), ("f", "false")):
        r, conf = dry_run(ddprun, ["--rdzv-conf", f"is_host={value}"])
        assert r.returncode == 0, (value, r.stderr)
        assert conf["rdzv_conf"].endswith(f"is_host={want}"), value
    r, conf = dry_run(ddprun, ["--rdzv-backend", "c10d", "--rdzv-endpoint", "  h:29501 "])
    assert conf["rdzv_endpoint"] == "h:29501", r.stderr
    r, conf = dry_run(ddprun, ["--rdzv-backend", "c10d", "--rdzv-endpoint", ""])
    assert r.returncode == 0, r.stderr
    assert conf["rdzv_endpoint"] == "localhost:29400", "torch's parse_rendezvous_endpoint of ''"
    r, conf = dry_run(ddprun, ["--rdzv-backend", "c10d"])
    assert r.returncode == 0, r.stderr
    assert conf["rdzv_endpoint"] == "localhost:29400", "no endpoint is torch's '' too"


@pytest.mark.parametrize("visible,want", [("-1", None), ("", None), ("0,1,", "2"),
                                          ("0,-1,2", "1"), ("none", None), ("1, 0", "2"),
                                          ("GPU-5a3c,1", "2"), ("0,x,1", "1")])
def test_cuda_visible_devices_is_read_as_cuda_reads_it(ddprun, visible, want):
    r, conf = dry_run(ddprun, ["--nproc-per-node", "gpu"], env={"CUDA_VISIBLE_DEVICES": visible})
    if want is None:
        assert r.returncode == 2 and "no GPU is visible" in r.stderr, r.stdout + r.stderr
    else:
        assert r.returncode == 0, r.stderr
        assert conf["nproc_per_node"] == want


def test_short_options_take_attached_values(ddprun):
    r, conf = dry_run(ddprun, ["--nproc-per-node", "2", "-r3", "-t1"])
    assert r.returncode == 0, r.stderr
    assert conf["redirects"] == "3 3" and conf["tee"] == "1 1"
    r, _ = dry_run(ddprun, ["-mx"])
    assert r.returncode == 2 and "unknown option -mx" in r.stderr, r.stderr
