"""deploy/k8s holds together: the Indexed Job's pods are in the headless Service's subdomain and
dial pod 0's name on the Service's port; N is the same in completions, parallelism and --nnodes;
the container's arguments are ones ddprun accepts (--dry-run, as pod 1 would run them); the
permanent exit codes fail the Job; the train.conf in the ConfigMap is one ddpworker accepts."""
import os
import re
import subprocess

import pytest

from conftest import ROOT, clean_env

yaml = pytest.importorskip("yaml", reason="PyYAML is not installed (Debian: python3-yaml)")
K8S = os.path.join(ROOT, "deploy", "k8s")


def load(name):
    return yaml.safe_load(open(os.path.join(K8S, name)))


def permanent_exit_codes():
    """ddp_exit_is_permanent's codes, and 73 (ddprun's --log-dir), which no restart fixes."""
    text = open(os.path.join(ROOT, "proto", "exit_codes.h")).read()
    values = dict((n, int(v)) for n, v in re.findall(r"(DDP_EXIT_\w+)\s*=\s*(\d+)", text))
    body = text[text.index("ddp_exit_is_permanent"):]
    body = body[:body.index("}")]
    return {values[n] for n in re.findall(r"DDP_EXIT_\w+", body)} | {values["DDP_EXIT_CANT_CREATE"]}


def test_job_service_and_config_fit_together():
    job, svc, conf = load("job.yaml"), load("service.yaml"), load("train-conf.yaml")
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    name, service = job["metadata"]["name"], svc["metadata"]["name"]
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"]
    assert pod["restartPolicy"] == "Never"  # podFailurePolicy needs it, and ddprun restarts itself
    assert pod["subdomain"] == service
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"]
    assert svc["spec"]["selector"] == {"job-name": name}
    (container,) = pod["containers"]
    args = dict(a[2:].split("=", 1) for a in container["args"] if a.startswith("--"))
    assert int(args["nnodes"]) == spec["completions"]
    host, port = args["rdzv-endpoint"].rsplit(":", 1)
    assert host == f"{name}-0.{service}", "the endpoint is not pod 0's name in the subdomain"
    assert int(port) in [p["port"] for p in svc["spec"]["ports"]]
    assert args["node-rank"] == "$(JOB_COMPLETION_INDEX)"
    assert "nvidia.com/gpu" in container["resources"]["limits"]
    assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] != 0
    rules = spec["podFailurePolicy"]["rules"]
    fail = [r for r in rules if r["action"] == "FailJob"][0]["onExitCodes"]
    assert fail["containerName"] == container["name"]
    assert set(fail["values"]) == permanent_exit_codes()
    conf_file = container["args"][-1]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    conf_vol = [n for n, v in volumes.items() if "configMap" in v][0]
    assert volumes[conf_vol]["configMap"]["name"] == conf["metadata"]["name"]
    assert conf_file == os.path.join(mounts[conf_vol], "train.conf")
    assert "train.conf" in conf["data"]


def test_pod_arguments_are_ones_ddprun_accepts(ddprun):
    (container,) = load("job.yaml")["spec"]["template"]["spec"]["containers"]
    # as Kubernetes expands them for pod 1; --nproc-per-node gpu needs a GPU, 4 stands for it
    args = [a.replace("$(JOB_COMPLETION_INDEX)", "1").replace("=gpu", "=4")
            for a in container["args"]]
    r = subprocess.run([ddprun, "--dry-run", *args], capture_output=True, text=True, timeout=60,
                       env=clean_env())
    assert r.returncode == 0, r.stderr
    cfg = dict(line.split(": ", 1) for line in r.stdout.splitlines() if ": " in line)
    assert cfg["rdzv_backend"] == "c10d" and cfg["node_rank"] == "1"
    assert cfg["rdzv_endpoint"] == "ddprun-train-0.ddprun-train:29400"


def test_the_configmap_train_conf_is_valid(ddpworker, tmp_path):
    conf = tmp_path / "train.conf"
    conf.write_text(load("train-conf.yaml")["data"]["train.conf"])
    # its keys and values as written; the data, paths and backend swapped for a quick CPU check
    r = subprocess.run([ddpworker, str(conf), "train.backend=cpu", "train.max_steps=0",
                        "data.kind=synthetic", "data.height=28", "data.width=28",
                        "data.channels=1", "data.train_limit=16", "data.test_limit=8",
                        "model.width=8", f"train.metrics_file={tmp_path}/m.jsonl",
                        f"train.params_file={tmp_path}/p.safetensors",
                        f"snapshot.dir={tmp_path}/snap"],
                       capture_output=True, text=True, timeout=300, env=clean_env())
    assert r.returncode == 0, r.stdout + r.stderr
