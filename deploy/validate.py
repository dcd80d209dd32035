#!/usr/bin/env python3
"""Offline checks for deploy/, called by deploy/validate.sh (run inside its virtualenv).

Subcommands:
  render DIR                 kustomize build of DIR, for the subset of kustomize deploy/k8s uses
                             (resources, components, namespace, labels, images, configMapGenerator and
                             secretGenerator with content-hash suffixes, patches: strategic merge
                             and JSON 6902). Anything else is refused, never silently ignored.
  same A B                   two rendered streams hold the same objects (order-insensitive).
  k8s-policy FILE...         the project's own rules for rendered manifests (non-root, read-only
                             root, no capabilities, requests and limits, the api-server's exec
                             probes, TLS on every hop: certificates, their issuers and mounts).
  custom-resources DIR FILE...
                             every custom resource (an API group outside Kubernetes' own) in the
                             rendered FILEs against its JSON schema in DIR, named
                             <group>_<version>_<Kind>.json (deploy/schemas/README.md); a custom
                             resource without one is an error, never skipped.
  compose FILE               references inside a Compose file (depends_on targets, conditions,
                             images or builds, healthchecks for service_healthy, volumes, TLS
                             files in a mounted volume, a TLS api-server's health check, ...).
  collector FILE             an OpenTelemetry Collector config's pipelines use defined components.
  dockerfile DOCKERFILE ROOT the Dockerfile copies every workspace member, has the runtime targets,
                             runs them as a non-root user; .dockerignore keeps the members.
"""

from __future__ import annotations

import base64
import copy
import fnmatch
import hashlib
import json
import os
import re
import sys
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

import yaml


class Problem(Exception):
    pass


def load_all(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as handle:
        return [doc for doc in yaml.safe_load_all(handle) if doc is not None]


# ------------------------------------------------------------------------------------------------
# kustomize subset

KUSTOMIZATION_NAMES = ("kustomization.yaml", "kustomization.yml", "Kustomization")
SUPPORTED_KEYS = {
    "apiVersion", "kind", "resources", "namespace", "labels", "images",
    "configMapGenerator", "secretGenerator", "generatorOptions", "patches", "components",
}
CLUSTER_SCOPED = {
    "Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition",
    "PersistentVolume", "StorageClass", "PriorityClass", "IngressClass", "RuntimeClass",
    "ValidatingWebhookConfiguration", "MutatingWebhookConfiguration", "APIService",
}
# kustomize's legacy output order (kinds not listed sort after these, by kind name).
ORDER_FIRST = [
    "Namespace", "ResourceQuota", "StorageClass", "CustomResourceDefinition", "ServiceAccount",
    "PodSecurityPolicy", "Role", "ClusterRole", "RoleBinding", "ClusterRoleBinding", "ConfigMap",
    "Secret", "Endpoints", "Service", "LimitRange", "PriorityClass", "PersistentVolume",
    "PersistentVolumeClaim", "Deployment", "StatefulSet", "CronJob", "PodDisruptionBudget",
]
ORDER_LAST = ["MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"]
GENERATED = "__generated"  # internal marker: original name of a generated ConfigMap/Secret


def pod_specs(obj: dict):
    """(template metadata, pod spec) pairs of a workload."""
    kind, spec = obj.get("kind"), obj.get("spec") or {}
    if kind == "Pod":
        yield obj.setdefault("metadata", {}), spec
    elif kind in ("Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"):
        template = spec.get("template")
        if template:
            yield template.setdefault("metadata", {}), template.setdefault("spec", {})
    elif kind == "CronJob":
        template = ((spec.get("jobTemplate") or {}).get("spec") or {}).get("template")
        if template:
            yield template.setdefault("metadata", {}), template.setdefault("spec", {})


def containers(pod_spec: dict):
    for key in ("initContainers", "containers", "ephemeralContainers"):
        yield from pod_spec.get(key) or []


def go_json(value) -> str:
    """encoding/json.Marshal: sorted keys, compact, HTML characters escaped."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    for char, escaped in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"),
                          ("\u2028", "\\u2028"), ("\u2029", "\\u2029")):
        text = text.replace(char, escaped)
    return text


def content_hash(obj: dict) -> str:
    """kustomize's name suffix for a generated ConfigMap or Secret."""
    if obj["kind"] == "ConfigMap":
        encoded = {"kind": "ConfigMap", "name": "", "data": obj.get("data") or {}}
        if obj.get("binaryData"):
            encoded["binaryData"] = obj["binaryData"]
    else:
        encoded = {"kind": "Secret", "name": "", "type": obj.get("type", ""),
                   "data": obj.get("data") or {}}
    digest = hashlib.sha256(go_json(encoded).encode()).hexdigest()[:10]
    return digest.translate(str.maketrans({"0": "g", "1": "h", "3": "k", "a": "m", "e": "t"}))


def read_env_file(path: Path) -> dict[str, str]:
    data = {}
    for number, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if "=" not in line:
            raise Problem(f"{path}:{number}: expected KEY=VALUE (a bare key is not supported)")
        key, value = line.split("=", 1)
        data[key.strip()] = value
    return data


def generate(base: Path, spec: dict, kind: str, global_options: dict) -> dict:
    unknown = set(spec) - {"name", "namespace", "behavior", "literals", "envs", "env", "files",
                           "options", "type"}
    if unknown:
        raise Problem(f"{base}: {kind} generator: unsupported keys {sorted(unknown)}")
    data: dict[str, str] = {}
    for literal in spec.get("literals") or []:
        key, _, value = literal.partition("=")
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
            value = value[1:-1]
        data[key] = value
    for env in (spec.get("envs") or []) + ([spec["env"]] if spec.get("env") else []):
        data.update(read_env_file(base / env))
    for entry in spec.get("files") or []:
        key, _, path = entry.rpartition("=")
        data[key or Path(path).name] = (base / path).read_text(encoding="utf-8")
    options = {**global_options, **(spec.get("options") or {})}
    metadata = {"name": spec["name"]}
    if spec.get("namespace"):
        metadata["namespace"] = spec["namespace"]
    for field in ("labels", "annotations"):
        if options.get(field):
            metadata[field] = dict(options[field])
    obj = {"apiVersion": "v1", "kind": kind, "metadata": metadata}
    if kind == "ConfigMap":
        obj["data"] = data
    else:
        obj["type"] = spec.get("type", "Opaque")
        obj["data"] = {k: kustomize_base64(v) for k, v in data.items()}
    if not options.get("disableNameSuffixHash"):
        obj[GENERATED] = spec["name"]
    return obj


def kustomize_base64(value: str) -> str:
    """base64 as kustomize writes Secret data: past 70 characters, 70-character lines."""
    encoded = base64.b64encode(value.encode()).decode()
    if len(encoded) <= 70:
        return encoded
    return "".join(encoded[i:i + 70] + "\n" for i in range(0, len(encoded), 70))


def match_target(obj: dict, target: dict) -> bool:
    unknown = set(target) - {"group", "version", "kind", "name", "namespace"}
    if unknown:
        raise Problem(f"patch target: unsupported keys {sorted(unknown)}")
    api_version = obj.get("apiVersion", "")
    group, _, version = api_version.rpartition("/")
    meta = obj.get("metadata") or {}
    checks = [("group", group), ("version", version), ("kind", obj.get("kind")),
              ("name", meta.get("name")), ("namespace", meta.get("namespace"))]
    return all(key not in target or re.fullmatch(str(target[key]), str(actual or ""))
               for key, actual in checks)


def strategic_merge(target, patch):
    if isinstance(target, dict) and isinstance(patch, dict):
        for key, value in patch.items():
            if isinstance(key, str) and key.startswith("$"):
                raise Problem(f"strategic merge directive {key} is not supported")
            if value is None:
                target.pop(key, None)
            elif key in target:
                target[key] = strategic_merge(target[key], value)
            else:
                target[key] = copy.deepcopy(value)
        return target
    if isinstance(target, list) and isinstance(patch, list) and all(
            isinstance(item, dict) and "name" in item for item in target + patch):
        # As kustomize orders the result: the patch's items first, in its order (each merged
        # into the target's item of that name, if any), then the target's other items.
        by_name = {item["name"]: item for item in target}
        patched = {item["name"] for item in patch}
        merged = [strategic_merge(by_name[item["name"]], item) if item["name"] in by_name
                  else copy.deepcopy(item) for item in patch]
        return merged + [item for item in target if item["name"] not in patched]
    return copy.deepcopy(patch)


def json_pointer(path: str) -> list[str]:
    if not path.startswith("/"):
        raise Problem(f"JSON patch path {path!r} must start with /")
    return [part.replace("~1", "/").replace("~0", "~") for part in path[1:].split("/")]


def json6902(obj: dict, operations: list[dict]) -> None:
    for op in operations:
        kind, parts = op.get("op"), json_pointer(op.get("path", ""))
        if kind not in ("add", "replace", "remove"):
            raise Problem(f"JSON patch op {kind!r} is not supported")
        parent = obj
        for part in parts[:-1]:
            parent = parent[int(part)] if isinstance(parent, list) else parent[part]
        last = parts[-1]
        if isinstance(parent, list):
            index = len(parent) if last == "-" else int(last)
            if kind == "add":
                parent.insert(index, copy.deepcopy(op["value"]))
            elif kind == "replace":
                parent[index] = copy.deepcopy(op["value"])
            else:
                del parent[index]
        else:
            if kind in ("replace", "remove") and last not in parent:
                raise Problem(f"JSON patch {kind} of missing path {op['path']}")
            if kind == "remove":
                del parent[last]
            else:
                parent[last] = copy.deepcopy(op["value"])


def identity(obj: dict) -> tuple:
    meta = obj.get("metadata") or {}
    return obj.get("kind"), meta.get("namespace", ""), obj.get(GENERATED) or meta.get("name")


def build(directory: Path, accumulated: list[dict] | None = None) -> list[dict]:
    """A Kustomization's objects; with `accumulated`, DIR is a Component (kind Component) applied
    to the objects of the Kustomization that lists it: its resources are added to them, then its
    generators and transformers run over all of them, as kustomize does."""
    path = next((directory / name for name in KUSTOMIZATION_NAMES
                 if (directory / name).is_file()), None)
    if path is None:
        raise Problem(f"{directory}: no kustomization.yaml")
    (kustomization,) = load_all(path)
    unknown = set(kustomization) - SUPPORTED_KEYS
    if unknown:
        raise Problem(f"{path}: unsupported fields {sorted(unknown)}: extend deploy/validate.py")
    if (kustomization.get("kind") == "Component") != (accumulated is not None):
        raise Problem(f"{path}: a Component is used only under `components:`, and only a "
                      "Component there")

    objects: list[dict] = accumulated if accumulated is not None else []
    for entry in kustomization.get("resources") or []:
        target = directory / entry
        if "://" in entry or entry.startswith("github.com/"):
            raise Problem(f"{path}: remote resource {entry} is not supported offline")
        if target.is_dir():
            objects.extend(build(target))
        elif target.is_file():
            objects.extend(load_all(target))
        else:
            raise Problem(f"{path}: resource {entry} does not exist")
    for entry in kustomization.get("components") or []:
        target = directory / entry
        if "://" in entry or not target.is_dir():
            raise Problem(f"{path}: component {entry} is not a local directory")
        objects = build(target, objects)

    global_options = kustomization.get("generatorOptions") or {}
    for field, kind in (("configMapGenerator", "ConfigMap"), ("secretGenerator", "Secret")):
        for spec in kustomization.get(field) or []:
            generated = generate(directory, spec, kind, global_options)
            behavior = spec.get("behavior", "create")
            existing = [obj for obj in objects if identity(obj)[0] == kind
                        and identity(obj)[2] == spec["name"]]
            if behavior == "create":
                if existing:
                    raise Problem(f"{path}: {kind} {spec['name']} already exists (use behavior)")
                objects.append(generated)
            elif behavior in ("merge", "replace"):
                if len(existing) != 1:
                    raise Problem(f"{path}: {behavior} of {kind} {spec['name']}: found "
                                  f"{len(existing)} to {behavior}")
                old = existing[0]
                if behavior == "merge":
                    old.setdefault("data", {}).update(generated["data"])
                    for meta_field in ("labels", "annotations"):
                        if generated["metadata"].get(meta_field):
                            old["metadata"].setdefault(meta_field, {}).update(
                                generated["metadata"][meta_field])
                else:
                    objects[objects.index(old)] = generated
            else:
                raise Problem(f"{path}: unknown generator behavior {behavior}")

    for patch_spec in kustomization.get("patches") or []:
        unknown = set(patch_spec) - {"path", "patch", "target"}
        if unknown:
            raise Problem(f"{path}: patch: unsupported keys {sorted(unknown)}")
        text = (directory / patch_spec["path"]).read_text(encoding="utf-8") \
            if "path" in patch_spec else patch_spec["patch"]
        docs = [doc for doc in yaml.safe_load_all(text) if doc is not None]
        if len(docs) != 1:
            raise Problem(f"{path}: a patch must hold exactly one document")
        (patch,) = docs
        target = patch_spec.get("target")
        if target is None:
            if not isinstance(patch, dict):
                raise Problem(f"{path}: a JSON 6902 patch needs a target")
            target = {"kind": patch.get("kind"), "name": (patch.get("metadata") or {}).get("name")}
        matched = [obj for obj in objects if match_target(obj, target)]
        if not matched:
            raise Problem(f"{path}: patch target {target} matches nothing")
        for obj in matched:
            if isinstance(patch, list):
                json6902(obj, patch)
            else:
                body = {k: v for k, v in patch.items() if k not in ("apiVersion", "kind")}
                body["metadata"] = {k: v for k, v in (body.get("metadata") or {}).items()
                                    if k not in ("name", "namespace")}
                strategic_merge(obj, body)

    namespace = kustomization.get("namespace")
    if namespace:
        for obj in objects:
            if obj.get("kind") not in CLUSTER_SCOPED:
                obj.setdefault("metadata", {})["namespace"] = namespace

    for label_spec in kustomization.get("labels") or []:
        unknown = set(label_spec) - {"pairs", "includeTemplates", "includeSelectors"}
        if unknown or label_spec.get("includeSelectors"):
            raise Problem(f"{path}: labels: only pairs and includeTemplates are supported")
        pairs = label_spec.get("pairs") or {}
        for obj in objects:
            obj.setdefault("metadata", {}).setdefault("labels", {}).update(pairs)
            if label_spec.get("includeTemplates"):
                if obj.get("kind") == "CronJob":
                    job_template = obj["spec"].setdefault("jobTemplate", {})
                    job_template.setdefault("metadata", {}).setdefault("labels", {}).update(pairs)
                for meta, _ in pod_specs(obj):
                    meta.setdefault("labels", {}).update(pairs)

    for image in kustomization.get("images") or []:
        unknown = set(image) - {"name", "newName", "newTag", "digest"}
        if unknown:
            raise Problem(f"{path}: images: unsupported keys {sorted(unknown)}")
        for obj in objects:
            for _, spec in pod_specs(obj):
                for container in containers(spec):
                    ref = container.get("image", "")
                    name = re.split(r"@", ref)[0]
                    name = name.rsplit(":", 1)[0] if ":" in name.rsplit("/", 1)[-1] else name
                    if name != image["name"]:
                        continue
                    tag = ref[len(name):]
                    new = image.get("newName", name)
                    if image.get("digest"):
                        tag = "@" + image["digest"]
                    elif image.get("newTag") is not None:
                        tag = f":{image['newTag']}"
                    container["image"] = new + tag
    return objects


def finish(objects: list[dict]) -> list[dict]:
    """Hash suffixes on generated objects, and every reference to them renamed."""
    renames: dict[tuple, str] = {}
    for obj in objects:
        original = obj.pop(GENERATED, None)
        if original:
            new = f"{original}-{content_hash(obj)}"
            obj["metadata"]["name"] = new
            renames[(obj["kind"], obj["metadata"].get("namespace", ""), original)] = new

    def rename(kind: str, namespace: str, holder: dict, key: str) -> None:
        if isinstance(holder, dict) and holder.get(key) is not None:
            holder[key] = renames.get((kind, namespace, holder[key]), holder[key])

    for obj in objects:
        namespace = (obj.get("metadata") or {}).get("namespace", "")
        for _, spec in pod_specs(obj):
            for container in containers(spec):
                for source in container.get("envFrom") or []:
                    rename("ConfigMap", namespace, source.get("configMapRef"), "name")
                    rename("Secret", namespace, source.get("secretRef"), "name")
                for env in container.get("env") or []:
                    value_from = env.get("valueFrom") or {}
                    rename("ConfigMap", namespace, value_from.get("configMapKeyRef"), "name")
                    rename("Secret", namespace, value_from.get("secretKeyRef"), "name")
            for volume in spec.get("volumes") or []:
                rename("ConfigMap", namespace, volume.get("configMap"), "name")
                rename("Secret", namespace, volume.get("secret"), "secretName")
                for source in (volume.get("projected") or {}).get("sources") or []:
                    rename("ConfigMap", namespace, source.get("configMap"), "name")
                    rename("Secret", namespace, source.get("secret"), "name")
            for pull_secret in spec.get("imagePullSecrets") or []:
                rename("Secret", namespace, pull_secret, "name")

    def order(obj: dict):
        kind = obj.get("kind", "")
        meta = obj.get("metadata") or {}
        if kind in ORDER_FIRST:
            rank = (0, ORDER_FIRST.index(kind), "")
        elif kind in ORDER_LAST:
            rank = (2, ORDER_LAST.index(kind), "")
        else:
            rank = (1, 0, kind)
        return rank, meta.get("namespace", ""), meta.get("name", "")

    return sorted(objects, key=order)


def canonical(objects: list[dict]) -> list[str]:
    return sorted(json.dumps(obj, sort_keys=True) for obj in objects)


# ------------------------------------------------------------------------------------------------
# Policy for rendered manifests

def k8s_policy(paths: list[Path]) -> list[str]:
    problems: list[str] = []
    objects = [obj for path in paths for obj in load_all(path)]
    by_kind: dict[str, dict[str, dict]] = {}
    for obj in objects:
        by_kind.setdefault(obj["kind"], {})[obj["metadata"]["name"]] = obj
    for obj in objects:
        where = f"{obj['kind']}/{obj['metadata']['name']}"
        for _, spec in pod_specs(obj):
            pod_security = spec.get("securityContext") or {}
            if not pod_security.get("runAsNonRoot"):
                problems.append(f"{where}: pod securityContext.runAsNonRoot is not true")
            if spec.get("automountServiceAccountToken") is not False:
                problems.append(f"{where}: automountServiceAccountToken is not false")
            for container in containers(spec):
                name = f"{where} container {container['name']}"
                security = container.get("securityContext") or {}
                if security.get("readOnlyRootFilesystem") is not True:
                    problems.append(f"{name}: readOnlyRootFilesystem is not true")
                if security.get("allowPrivilegeEscalation") is not False:
                    problems.append(f"{name}: allowPrivilegeEscalation is not false")
                if (security.get("capabilities") or {}).get("drop") != ["ALL"]:
                    problems.append(f"{name}: capabilities.drop is not [ALL]")
                resources = container.get("resources") or {}
                for field in ("requests", "limits"):
                    if not {"cpu", "memory"} <= set(resources.get(field) or {}):
                        problems.append(f"{name}: resources.{field} lacks cpu or memory")
                image = container.get("image", "")
                if ":" not in image.rsplit("/", 1)[-1] and "@" not in image:
                    problems.append(f"{name}: image {image!r} has no tag or digest")
            for env_container in containers(spec):
                from_secrets: set[str] = set()
                for env in env_container.get("env") or []:
                    if ((env.get("valueFrom") or {}).get("secretKeyRef")):
                        from_secrets.add(env["name"])
                    # A value may build on a variable from a Secret ($(VAR)…, Kubernetes expands it)
                    # and add only what is not secret, e.g. the TLS parameters of a URL.
                    reference = re.match(r"\$\((\w+)\)", env.get("value") or "")
                    if re.search(r"(TOKEN|SECRET|PASSWORD|_URL)$", env["name"]) and "value" in env \
                            and env["name"] not in ("API_SERVER_URL", "SMTP_URL") \
                            and not (reference and reference.group(1) in from_secrets):
                        problems.append(f"{where}: {env['name']} set inline, not from a Secret")
        if obj["kind"] == "CronJob" and obj["spec"].get("concurrencyPolicy") != "Forbid":
            problems.append(f"{where}: concurrencyPolicy is not Forbid")
    api = (by_kind.get("Deployment") or {}).get("api-server")
    if api is None:
        problems.append("no Deployment api-server")
    else:
        (container,) = [c for c in api["spec"]["template"]["spec"]["containers"]
                        if c["name"] == "api-server"]
        problems.extend(health_check_probes(container))
        if "preStop" not in (container.get("lifecycle") or {}):
            problems.append("Deployment/api-server: no preStop hook")
        if "replicas" in api["spec"]:
            problems.append("Deployment/api-server: replicas is set although an HPA owns it")
    for kind, name in (("HorizontalPodAutoscaler", "api-server"),
                       ("PodDisruptionBudget", "api-server"), ("Job", "api-server-migrate"),
                       ("Deployment", "enqueuer"), ("Deployment", "receipts"),
                       ("CronJob", "completer"), ("CronJob", "reaper"), ("CronJob", "reconciler"),
                       ("Service", "api-server")):
        if name not in (by_kind.get(kind) or {}):
            problems.append(f"missing {kind}/{name}")
    for kind, name, args in (("CronJob", "completer", ["completer", "--once"]),
                             ("CronJob", "reaper", ["reaper", "--once"]),
                             ("CronJob", "reconciler", ["reconciler", "--once"])):
        obj = (by_kind.get(kind) or {}).get(name)
        if obj:
            (_, spec), = pod_specs(obj)
            if spec["containers"][0].get("args") != args:
                problems.append(f"{kind}/{name}: args are not {args}")
    # High availability, where an overlay runs the engines through their operators: PostgreSQL
    # commits wait for a synchronous standby and a standby is left to fail over to; RabbitMQ has
    # an odd number of nodes, at least three, so that quorum queues survive a node.
    for name, cluster in (by_kind.get("Cluster") or {}).items():
        if not cluster.get("apiVersion", "").startswith("postgresql.cnpg.io/"):
            continue
        spec = cluster.get("spec") or {}
        synchronous = (spec.get("postgresql") or {}).get("synchronous") or {}
        sync = synchronous.get("number") or spec.get("minSyncReplicas") or 0
        if sync < 1:
            problems.append(f"Cluster/{name}: no synchronous replica (postgresql.synchronous."
                            "number or minSyncReplicas)")
        if spec.get("instances", 0) < sync + 2:
            problems.append(f"Cluster/{name}: with {spec.get('instances')} instances, losing one "
                            f"standby leaves fewer than {sync} synchronous standby(s)")
    for name, broker in (by_kind.get("RabbitmqCluster") or {}).items():
        replicas = (broker.get("spec") or {}).get("replicas", 1)
        if replicas < 3 or replicas % 2 == 0:
            problems.append(f"RabbitmqCluster/{name}: {replicas} replicas; quorum queues need an "
                            "odd number, at least 3")
    # Every referenced ConfigMap/Secret key exists when the object is in the stream.
    for obj in objects:
        for _, spec in pod_specs(obj):
            for container in containers(spec):
                for env in container.get("env") or []:
                    for ref_kind, ref_field in (("ConfigMap", "configMapKeyRef"),
                                                ("Secret", "secretKeyRef")):
                        ref = (env.get("valueFrom") or {}).get(ref_field)
                        if not ref:
                            continue
                        target = (by_kind.get(ref_kind) or {}).get(ref["name"])
                        if target is not None and ref["key"] not in (target.get("data") or {}):
                            problems.append(f"{obj['kind']}/{obj['metadata']['name']}: "
                                            f"{ref_kind} {ref['name']} has no key {ref['key']}")
    problems.extend(tls_policy(objects, by_kind))
    problems.extend(monitoring_policy(objects))
    return list(dict.fromkeys(problems))  # once each, in order


def monitoring_policy(objects: list[dict]) -> list[str]:
    """Every pod template with a container port named `metrics` is scraped: a PodMonitor selects
    its pods, or a ServiceMonitor selects a Service that selects them and exposes that port; each
    monitor's port exists on what it selects. Every monitoring.coreos.com object (rules and
    monitors) carries one and the same `release` label, the one a Prometheus selects them by."""
    problems: list[str] = []

    def matches(selector: dict, labels: dict) -> bool:
        if set(selector) - {"matchLabels"}:
            raise Problem(f"selector {selector}: only matchLabels is checked")
        wanted = selector.get("matchLabels") or {}
        return bool(wanted) and all(labels.get(k) == v for k, v in wanted.items())

    pods = [(f"{obj['kind']}/{obj['metadata']['name']}", meta.get("labels") or {}, spec)
            for obj in objects for meta, spec in pod_specs(obj)]
    services = [obj for obj in objects if obj["kind"] == "Service"]
    scraped: set[str] = set()
    for monitor in objects:
        if monitor["kind"] not in ("PodMonitor", "ServiceMonitor"):
            continue
        where = f"{monitor['kind']}/{monitor['metadata']['name']}"
        spec = monitor["spec"]
        if monitor["kind"] == "PodMonitor":
            ports = [ep.get("port") for ep in spec.get("podMetricsEndpoints") or []]
            selected = [pod for pod in pods if matches(spec["selector"], pod[1])]
            for name, _, pod_spec in selected:
                names = {port.get("name") for c in containers(pod_spec) for port in c.get("ports") or []}
                if set(ports) <= names:
                    scraped.add(name)
                else:
                    problems.append(f"{where}: {name} has no container port {sorted(set(ports) - names)}")
            # The operators' pods (CloudNativePG, RabbitMQ) are not in the rendering.
            if not selected and not any(k.startswith("cnpg.io/") or k == "app.kubernetes.io/component"
                                        and v == "rabbitmq"
                                        for k, v in (spec["selector"].get("matchLabels") or {}).items()):
                problems.append(f"{where}: selects no pod of the rendering")
        else:
            ports = {ep.get("port") for ep in spec.get("endpoints") or []}
            selected = [svc for svc in services if matches(spec["selector"], svc["metadata"].get("labels") or {})
                        and ports & {port.get("name") for port in svc["spec"].get("ports") or []}]
            if not selected:
                problems.append(f"{where}: no Service it selects has port {sorted(ports)}")
            for svc in selected:
                for name, labels, _ in pods:
                    if matches({"matchLabels": svc["spec"].get("selector") or {}}, labels):
                        scraped.add(name)
    for name, _, pod_spec in pods:
        if any(port.get("name") == "metrics" for c in containers(pod_spec) for port in c.get("ports") or []) \
                and name not in scraped:
            problems.append(f"{name}: serves a `metrics` port that no ServiceMonitor or PodMonitor scrapes")
    releases = {}
    for obj in objects:
        if obj.get("apiVersion", "").startswith("monitoring.coreos.com/"):
            releases[f"{obj['kind']}/{obj['metadata']['name']}"] = (obj["metadata"].get("labels") or {}).get("release")
    if releases and (None in releases.values() or len(set(releases.values())) > 1):
        problems.append("monitoring.coreos.com objects without one common `release` label "
                        f"(deploy/k8s/components/prometheus-release): {releases}")
    return problems


# ------------------------------------------------------------------------------------------------
# TLS on every hop (issue 33): probes, certificates, their issuers, and the files processes read

# The api-server's probes: `api-server health-check --service S` (exec; the kubelet's gRPC probe
# cannot speak TLS). The check answers within 2 s (a 1 s dial, then the call), so a probe's
# timeoutSeconds must be at least 2.
HEALTH_CHECK_PROBES = (("startupProbe", "liveness"), ("livenessProbe", "liveness"),
                       ("readinessProbe", "rides.v1.RideService"))
HEALTH_CHECK_TIMEOUT_SECS = 2
# Settings that name a PEM file (docs/configuration.md): variables, URL query parameters, and
# command-line flags (the mail sink's certificate; the health check's --ca).
TLS_FILE_VARIABLES = ("GRPC_TLS_CERT", "GRPC_TLS_KEY", "GRPC_TLS_CLIENT_CA", "API_SERVER_CA",
                      "API_SERVER_CLIENT_CERT", "API_SERVER_CLIENT_KEY")
TLS_FILE_PARAMETERS = ("cacertfile", "sslrootcert")
TLS_FILE_FLAGS = ("--tls-cert", "--tls-key", "--ca")
SERVER_CERT_VARIABLES, SERVER_CERT_FLAGS = ("GRPC_TLS_CERT",), ("--tls-cert",)
# The keys cert-manager writes to a Certificate's Secret.
CERTIFICATE_SECRET_KEYS = {"tls.crt", "tls.key", "ca.crt"}
# Client URLs whose peer, when it runs in the rendering, must be reached over verified TLS.
TLS_URL_VARIABLES = ("DATABASE_URL", "AMQP_URL", "SMTP_URL", "API_SERVER_URL")
# The processes that read a variable (docs/configuration.md, "Used by"), named by a container's
# first argument (`serve`, `receipts`, ...); one not listed is read by all. The shared ConfigMap
# hands every process SMTP_URL, but only the receipt worker dials it.
READ_BY = {
    "GRPC_TLS_CERT": {"serve"}, "GRPC_TLS_KEY": {"serve"}, "GRPC_TLS_CLIENT_CA": {"serve"},
    "API_SERVER_URL": {"completer"}, "API_SERVER_CA": {"completer"},
    "API_SERVER_CLIENT_CERT": {"completer"}, "API_SERVER_CLIENT_KEY": {"completer"},
    "AMQP_URL": {"enqueuer", "receipts", "admin"}, "SMTP_URL": {"receipts"},
}


def health_check_probes(container: dict) -> list[str]:
    problems = []
    for probe, service in HEALTH_CHECK_PROBES:
        spec = container.get(probe) or {}
        command = (spec.get("exec") or {}).get("command") or []
        where = f"Deployment/api-server: {probe}"
        if not command:
            problems.append(f"{where} is not an exec probe running `api-server health-check` "
                            "(the kubelet's gRPC probe cannot speak TLS)")
            continue
        if Path(command[0]).name != "api-server" or command[1:2] != ["health-check"]:
            problems.append(f"{where} runs {command}, not `api-server health-check`")
        asked = command[command.index("--service") + 1] \
            if "--service" in command[:-1] else None
        if asked != service:
            problems.append(f"{where} asks for {asked!r}, not {service!r}")
        if spec.get("timeoutSeconds", 1) < HEALTH_CHECK_TIMEOUT_SECS:
            problems.append(f"{where}: timeoutSeconds {spec.get('timeoutSeconds', 1)} is shorter "
                            f"than the health check's {HEALTH_CHECK_TIMEOUT_SECS} s")
    return problems


def secret_text(secret: dict) -> dict[str, str]:
    data = {}
    for key, value in (secret.get("data") or {}).items():
        try:
            data[key] = base64.b64decode(value.replace("\n", "")).decode()
        except (ValueError, UnicodeDecodeError):
            data[key] = ""
    data.update(secret.get("stringData") or {})
    return data


def container_env(container: dict, by_kind: dict) -> tuple[dict, dict]:
    """The variables a container's process reads (READ_BY), as far as the rendering shows them
    (None: not in it, e.g. from a Secret a secret manager makes), and for each variable from a
    Secret, that Secret's name."""
    values: dict[str, str | None] = {}
    sources: dict[str, str] = {}
    for source in container.get("envFrom") or []:
        if source.get("configMapRef"):
            config = (by_kind.get("ConfigMap") or {}).get(source["configMapRef"]["name"]) or {}
            values.update(config.get("data") or {})
        if source.get("secretRef"):
            secret = (by_kind.get("Secret") or {}).get(source["secretRef"]["name"])
            values.update(secret_text(secret) if secret else {})
    for env in container.get("env") or []:
        name, value_from = env["name"], env.get("valueFrom") or {}
        if "value" in env:
            values[name] = re.sub(r"\$\((\w+)\)", lambda m: values.get(m.group(1)) or m.group(0),
                                  env["value"])
        elif value_from.get("configMapKeyRef"):
            ref = value_from["configMapKeyRef"]
            values[name] = ((by_kind.get("ConfigMap") or {}).get(ref["name"]) or {}) \
                .get("data", {}).get(ref["key"])
        elif value_from.get("secretKeyRef"):
            ref = value_from["secretKeyRef"]
            secret = (by_kind.get("Secret") or {}).get(ref["name"])
            values[name] = secret_text(secret).get(ref["key"]) if secret else None
            sources[name] = ref["name"]
        else:
            values[name] = None
    process = (container.get("args") or [""])[0]
    read = {name: value for name, value in values.items()
            if name not in READ_BY or process in READ_BY[name]}
    return read, sources


def tls_file_references(container: dict, values: dict) -> list[tuple[str, str]]:
    """(what names it, path) for every PEM file the container is configured to read."""
    files = [(name, values[name]) for name in TLS_FILE_VARIABLES if values.get(name)]
    for name, value in values.items():
        if name.endswith("_URL") and value:
            for parameter, path in re.findall(
                    rf"[?&]({'|'.join(TLS_FILE_PARAMETERS)})=([^&,]*)", value):
                files.append((f"{name} {parameter}=", unquote(path)))
    words = list(container.get("command") or []) + list(container.get("args") or [])
    for probe, _ in HEALTH_CHECK_PROBES:
        words += ((container.get(probe) or {}).get("exec") or {}).get("command") or []
    for index, word in enumerate(words):
        for flag in TLS_FILE_FLAGS:
            if word == flag and index + 1 < len(words):
                files.append((flag, words[index + 1]))
            elif word.startswith(flag + "="):
                files.append((flag, word.split("=", 1)[1]))
    return files


def secret_makers(objects: list[dict]) -> dict[tuple[str, str], dict]:
    """(namespace, Secret name) -> what makes that Secret in the rendering: a cert-manager
    Certificate, or an operator whose custom resource is rendered (documented behaviour:
    CloudNativePG keeps each Cluster's own CA in the Secret <cluster>-ca, keys ca.crt and ca.key)."""
    makers: dict[tuple[str, str], dict] = {}
    for obj in objects:
        meta = obj.get("metadata") or {}
        namespace, spec = meta.get("namespace", ""), obj.get("spec") or {}
        if obj.get("kind") == "Certificate" and obj["apiVersion"].startswith("cert-manager.io/"):
            makers[(namespace, spec.get("secretName"))] = {
                "by": f"Certificate/{meta['name']}", "keys": CERTIFICATE_SECRET_KEYS,
                "ca": bool(spec.get("isCA")), "certificate": obj}
        if obj.get("kind") == "Cluster" and obj["apiVersion"].startswith("postgresql.cnpg.io/"):
            makers[(namespace, f"{meta['name']}-ca")] = {
                "by": f"CloudNativePG Cluster/{meta['name']}", "keys": {"ca.crt", "ca.key"},
                "ca": True, "certificate": None}
    return makers


def secret_volumes(pod_spec: dict) -> dict[str, list[tuple[str, list | None]]]:
    """volume name -> [(Secret name, items or None)] for Secret and projected volumes."""
    volumes = {}
    for volume in pod_spec.get("volumes") or []:
        if volume.get("secret"):
            volumes[volume["name"]] = [(volume["secret"].get("secretName"),
                                        volume["secret"].get("items"))]
        elif volume.get("projected"):
            volumes[volume["name"]] = [(source["secret"].get("name"), source["secret"].get("items"))
                                       for source in volume["projected"].get("sources") or []
                                       if source.get("secret")]
    return volumes


def tls_file_secret(where: str, what: str, path: str, container: dict, pod_spec: dict,
                    namespace: str, makers: dict, problems: list[str]) -> dict | None:
    """The maker of the Secret that holds `path`, checking that the file is in a read-only mount
    of a Secret volume, that the Secret is made in the rendering, and that it has that key."""
    mounts = [mount for mount in container.get("volumeMounts") or []
              if path.startswith(mount["mountPath"].rstrip("/") + "/")]
    if not mounts:
        problems.append(f"{where}: {what} names {path}, which no volumeMount holds")
        return None
    mount = max(mounts, key=lambda m: len(m["mountPath"]))
    if not mount.get("readOnly"):
        problems.append(f"{where}: volume {mount['name']} ({what} {path}) is not mounted readOnly")
    if mount.get("subPath"):
        problems.append(f"{where}: volume {mount['name']} is mounted with subPath, which a renewed "
                        "Secret never reaches")
    sources = secret_volumes(pod_spec).get(mount["name"])
    if not sources:
        problems.append(f"{where}: {what} {path} is in volume {mount['name']}, not a Secret volume")
        return None
    relative = path[len(mount["mountPath"].rstrip("/")) + 1:]
    for secret_name, items in sources:
        key = relative if items is None else next(
            (item["key"] for item in items if item.get("path") == relative), None)
        if key is None:
            continue
        maker = makers.get((namespace, secret_name))
        if maker is None:
            problems.append(f"{where}: {what} {path} comes from Secret {secret_name}, which no "
                            "Certificate in the rendering (nor an operator it runs) makes")
        elif key not in maker["keys"]:
            problems.append(f"{where}: {what} {path}: Secret {secret_name} ({maker['by']}) has no "
                            f"key {key}")
        return maker
    problems.append(f"{where}: {what} {path}: volume {mount['name']} does not project that file")
    return None


def tls_policy(objects: list[dict], by_kind: dict) -> list[str]:
    problems: list[str] = []
    makers = secret_makers(objects)
    namespaces = {(obj.get("metadata") or {}).get("namespace", "") for obj in objects}
    namespace = sorted(namespaces - {""})[0] if namespaces - {""} else ""

    # Certificates: one per Secret, each issued by an issuer of the rendering; a CA issuer's key
    # pair is made by a CA Certificate of the rendering.
    issuers = {(o["metadata"].get("namespace", ""), o["metadata"]["name"]): o for o in objects
               if o.get("kind") == "Issuer" and o["apiVersion"].startswith("cert-manager.io/")}
    cluster_issuers = {o["metadata"]["name"]: o for o in objects
                       if o.get("kind") == "ClusterIssuer"
                       and o["apiVersion"].startswith("cert-manager.io/")}
    secrets_seen: dict[tuple[str, str], str] = {}
    for obj in objects:
        if obj.get("kind") != "Certificate" or not obj["apiVersion"].startswith("cert-manager.io/"):
            continue
        meta, spec = obj["metadata"], obj.get("spec") or {}
        where, ns = f"Certificate/{meta['name']}", meta.get("namespace", "")
        previous = secrets_seen.setdefault((ns, spec.get("secretName")), meta["name"])
        if previous != meta["name"]:
            problems.append(f"{where}: Secret {spec.get('secretName')} is Certificate/{previous}'s too")
        ref = spec.get("issuerRef") or {}
        kind, group = ref.get("kind", "Issuer"), ref.get("group", "cert-manager.io")
        issuer = issuers.get((ns, ref.get("name"))) if kind == "Issuer" else \
            cluster_issuers.get(ref.get("name")) if kind == "ClusterIssuer" else None
        if group != "cert-manager.io" or issuer is None:
            problems.append(f"{where}: issuerRef {group}/{kind}/{ref.get('name')} is no Issuer or "
                            "ClusterIssuer of the rendering")
    for (ns, name), issuer in list(issuers.items()) + [(("", n), o) for n, o in cluster_issuers.items()]:
        ca = (issuer.get("spec") or {}).get("ca")
        if not ca:
            continue
        maker = makers.get((ns, ca.get("secretName"))) if issuer["kind"] == "Issuer" else next(
            (m for (_, secret), m in makers.items() if secret == ca.get("secretName")), None)
        if not maker or not maker["ca"] or not maker["certificate"]:
            problems.append(f"{issuer['kind']}/{name}: its CA key pair, Secret {ca.get('secretName')}, "
                            "is made by no CA Certificate (isCA: true) of the rendering")

    # Every PEM file a process reads: in a read-only Secret volume whose Secret the rendering
    # makes; no pod mounts a CA's private key.
    server_certs: dict[str, list[tuple[dict, dict | None]]] = {}  # workload -> (container, cert)
    workloads = []
    for obj in objects:
        for template_meta, spec in pod_specs(obj):
            where = f"{obj['kind']}/{obj['metadata']['name']}"
            ns = obj["metadata"].get("namespace", "")
            workloads.append((obj, template_meta, spec))
            for volume, sources in secret_volumes(spec).items():
                for secret_name, items in sources:
                    maker = makers.get((ns, secret_name))
                    keys = {item["key"] for item in items} if items is not None else None
                    if maker and maker["ca"] and (keys is None or keys & {"tls.key", "ca.key"}):
                        problems.append(f"{where}: volume {volume} mounts the private key of the CA "
                                        f"in Secret {secret_name} (project only ca.crt: items)")
            for container in containers(spec):
                name = f"{where} container {container['name']}"
                values, _ = container_env(container, by_kind)
                for what, path in tls_file_references(container, values):
                    maker = tls_file_secret(name, what, path, container, spec, ns, makers, problems)
                    if what in SERVER_CERT_VARIABLES + SERVER_CERT_FLAGS:
                        server_certs.setdefault(where, []).append(
                            (container, maker and maker["certificate"]))

    # A server's certificate names every Service in front of it, as clients dial it.
    services = by_kind.get("Service") or {}
    serving: dict[str, list[str]] = {}  # Service -> workloads behind it
    for obj, template_meta, _ in workloads:
        labels = template_meta.get("labels") or {}
        for service_name, service in services.items():
            selector = (service.get("spec") or {}).get("selector") or {}
            if selector and selector.items() <= labels.items():
                serving.setdefault(service_name, []).append(f"{obj['kind']}/{obj['metadata']['name']}")
    for service_name, behind in serving.items():
        ns = services[service_name]["metadata"].get("namespace", "")
        wanted = {service_name, f"{service_name}.{ns}.svc", f"{service_name}.{ns}.svc.cluster.local"}
        for workload in behind:
            for container, certificate in server_certs.get(workload, []):
                if certificate is None:
                    continue
                missing = wanted - set((certificate.get("spec") or {}).get("dnsNames") or [])
                if missing:
                    problems.append(f"Certificate/{certificate['metadata']['name']} ({workload}'s) "
                                    f"lacks the name(s) {sorted(missing)} of Service/{service_name}")

    # The api-server serves mutual TLS, with a certificate its own probe can verify and present.
    api = (by_kind.get("Deployment") or {}).get("api-server")
    if api:
        (container,) = [c for c in api["spec"]["template"]["spec"]["containers"]
                        if c["name"] == "api-server"]
        values, _ = container_env(container, by_kind)
        for variable in ("GRPC_TLS_CERT", "GRPC_TLS_KEY", "GRPC_TLS_CLIENT_CA"):
            if not values.get(variable):
                problems.append(f"Deployment/api-server: {variable} is not set (mutual TLS)")
        for _, certificate in server_certs.get("Deployment/api-server", []):
            spec = (certificate or {}).get("spec") or {}
            if certificate is None:
                continue
            where = f"Certificate/{certificate['metadata']['name']} (the api-server's)"
            if not {"server auth", "client auth"} <= set(spec.get("usages") or []):
                problems.append(f"{where}: usages lack server auth or client auth (the health "
                                "check presents it as a client certificate)")
            if "localhost" not in (spec.get("dnsNames") or []) or \
                    "127.0.0.1" not in (spec.get("ipAddresses") or []):
                problems.append(f"{where}: lacks localhost or 127.0.0.1, which the health check "
                                "dials")

    # The completer calls the api-server over mutual TLS.
    completer = (by_kind.get("CronJob") or {}).get("completer")
    if completer:
        ((_, spec),) = pod_specs(completer)
        container = spec["containers"][0]
        values, _ = container_env(container, by_kind)
        url = values.get("API_SERVER_URL") or ""
        if not url.startswith("https://"):
            problems.append(f"CronJob/completer: API_SERVER_URL {url!r} is not https://")
        for variable in ("API_SERVER_CA", "API_SERVER_CLIENT_CERT", "API_SERVER_CLIENT_KEY"):
            if not values.get(variable):
                problems.append(f"CronJob/completer: {variable} is not set (mutual TLS)")
        if values.get("API_SERVER_CLIENT_CERT"):
            ns = completer["metadata"].get("namespace", "")
            maker = tls_file_secret("CronJob/completer", "API_SERVER_CLIENT_CERT",
                                    values["API_SERVER_CLIENT_CERT"], container, spec, ns, makers,
                                    [])
            usages = (((maker or {}).get("certificate") or {}).get("spec") or {}).get("usages")
            if maker and "client auth" not in (usages or []):
                problems.append(f"CronJob/completer: {maker['by']} has no `client auth` usage")

    # Peers that run in the rendering (its Services, the operators' clusters) are reached over
    # verified TLS: URLs the rendering shows are checked; where it runs the operators' clusters,
    # every client of them mounts their CA (its URL may come from a Secret made elsewhere).
    peers = {name: f"Service/{name}" for name in services}
    database_clusters = [o for o in by_kind.get("Cluster", {}).values()
                         if o["apiVersion"].startswith("postgresql.cnpg.io/")]
    brokers = list((by_kind.get("RabbitmqCluster") or {}).values())
    for cluster in database_clusters:
        for suffix in ("-rw", "-ro", "-r"):
            peers[cluster["metadata"]["name"] + suffix] = f"Cluster/{cluster['metadata']['name']}"
    for broker in brokers:
        peers[broker["metadata"]["name"]] = f"RabbitmqCluster/{broker['metadata']['name']}"
        peers[broker["metadata"]["name"] + "-nodes"] = f"RabbitmqCluster/{broker['metadata']['name']}"

    def peer_of(host: str | None) -> str | None:
        labels = (host or "").split(".")
        for index in (0, 1):  # a Service, or a pod under a headless Service
            if len(labels) > index and labels[index] in peers and \
                    (len(labels) == index + 1 or labels[index + 1] == namespace):
                return peers[labels[index]]
        return None

    for obj, _, spec in workloads:
        where = f"{obj['kind']}/{obj['metadata']['name']}"
        for container in containers(spec):
            values, sources = container_env(container, by_kind)
            for variable in TLS_URL_VARIABLES:
                value = values.get(variable)
                if not value:
                    continue
                # $(VAR) from an operator's Secret of the rendering (CloudNativePG's <cluster>-app).
                hinted = next((f"Cluster/{c['metadata']['name']}" for c in database_clusters
                               for ref in re.findall(r"\$\((\w+)\)", value)
                               if sources.get(ref, "").startswith(c["metadata"]["name"] + "-")), None)
                for url in value.split(",") if variable == "AMQP_URL" else [value]:
                    parts = urlsplit(url)
                    try:
                        host = parts.hostname
                    except ValueError:
                        host = None
                    peer = peer_of(host) or hinted
                    if peer is None:
                        continue
                    query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
                    verified = {
                        "DATABASE_URL": query.get("sslmode") == "verify-full"
                        and bool(query.get("sslrootcert")),
                        "AMQP_URL": parts.scheme == "amqps" and bool(query.get("cacertfile")),
                        "SMTP_URL": (parts.scheme == "smtps" or query.get("tls") == "required")
                        and bool(query.get("cacertfile")),
                        "API_SERVER_URL": parts.scheme == "https",
                    }[variable]
                    if not verified:
                        problems.append(f"{where}: {variable} reaches {peer} of the rendering "
                                        "without verified TLS (verify-full and sslrootcert, "
                                        "amqps:// and cacertfile, tls=required or smtps:// and "
                                        "cacertfile, https://)")
                    service = services.get(peer.split("/", 1)[1]) if peer.startswith("Service/") \
                        else None
                    if service is not None and not any(
                            certificate is not None for workload in serving.get(peer[8:], [])
                            for _, certificate in server_certs.get(workload, [])):
                        problems.append(f"{where}: {variable} reaches {peer}, whose pods serve no "
                                        "certificate of the rendering (GRPC_TLS_CERT, --tls-cert)")
            mounted = {secret for mount in container.get("volumeMounts") or []
                       for secret, _ in secret_volumes(spec).get(mount["name"], [])}
            if "DATABASE_URL" in values:
                for cluster in database_clusters:
                    if f"{cluster['metadata']['name']}-ca" not in mounted:
                        problems.append(f"{where} container {container['name']}: connects to "
                                        f"PostgreSQL but does not mount Secret "
                                        f"{cluster['metadata']['name']}-ca, the CA of Cluster/"
                                        f"{cluster['metadata']['name']}")
            if "AMQP_URL" in values:
                for broker in brokers:
                    tls = (broker.get("spec") or {}).get("tls") or {}
                    if tls.get("secretName") and tls["secretName"] not in mounted:
                        problems.append(f"{where} container {container['name']}: connects to "
                                        f"RabbitMQ but does not mount Secret {tls['secretName']}, "
                                        f"the CA of RabbitmqCluster/{broker['metadata']['name']}")

    # The operators' clusters serve TLS only: the brokers with a certificate of the rendering that
    # names the client Service and every node; CloudNativePG serves TLS always (its own CA).
    for broker in brokers:
        name, ns = broker["metadata"]["name"], broker["metadata"].get("namespace", "")
        where = f"RabbitmqCluster/{name}"
        tls = (broker.get("spec") or {}).get("tls") or {}
        maker = makers.get((ns, tls.get("secretName")))
        if not tls.get("secretName"):
            problems.append(f"{where}: no spec.tls.secretName: AMQP in plaintext")
            continue
        if not tls.get("disableNonTLSListeners"):
            problems.append(f"{where}: spec.tls.disableNonTLSListeners is not true: a plaintext "
                            "AMQP listener stays open")
        if not maker or not maker["certificate"]:
            problems.append(f"{where}: Secret {tls['secretName']} is made by no Certificate of the "
                            "rendering")
            continue
        names = set((maker["certificate"].get("spec") or {}).get("dnsNames") or [])
        wanted = {name, f"{name}.{ns}.svc", f"*.{name}-nodes.{ns}.svc"}
        if not wanted <= names:
            problems.append(f"{where}: {maker['by']} lacks {sorted(wanted - names)}")
    return problems


# ------------------------------------------------------------------------------------------------
# Custom resources (operators' CRDs, which kubernetes-validate has no schema for)

def is_custom_resource(obj: dict) -> bool:
    """An API group that is not Kubernetes' own: core (no group), a group without a dot (apps,
    batch, autoscaling, policy) or one under k8s.io."""
    group = obj.get("apiVersion", "").rpartition("/")[0]
    return "." in group and not (group == "k8s.io" or group.endswith(".k8s.io"))


def custom_resources(schema_dir: Path, paths: list[Path]) -> list[str]:
    import jsonschema  # check-jsonschema's dependency, in deploy/validate.sh's virtualenv

    problems: list[str] = []
    for path in paths:
        for obj in load_all(path):
            if not is_custom_resource(obj):
                continue
            group, _, version = obj["apiVersion"].rpartition("/")
            where = f"{path.name}: {obj['kind']}/{(obj.get('metadata') or {}).get('name')}"
            schema_path = schema_dir / f"{group}_{version}_{obj['kind']}.json"
            if not schema_path.is_file():
                problems.append(f"{where}: no schema {schema_path} (vendor one: "
                                f"{schema_dir}/README.md)")
                continue
            schema = json.loads(schema_path.read_text(encoding="utf-8"))
            validator = jsonschema.Draft7Validator(schema)
            for error in sorted(validator.iter_errors(obj), key=lambda e: list(e.absolute_path)):
                field = ".".join(str(part) for part in error.absolute_path) or "(object)"
                problems.append(f"{where}: {field}: {error.message}")
    return problems


# ------------------------------------------------------------------------------------------------
# Compose

def compose(path: Path) -> list[str]:
    problems: list[str] = []
    (doc,) = load_all(path)
    services = doc.get("services") or {}
    volumes = set(doc.get("volumes") or {})
    if not services:
        return [f"{path}: no services"]
    for name, service in services.items():
        where = f"{path}: service {name}"
        if "image" not in service and "build" not in service:
            problems.append(f"{where}: neither image nor build")
        build = service.get("build")
        if isinstance(build, dict):
            context = (path.parent / build.get("context", ".")).resolve()
            dockerfile = context / build.get("dockerfile", "Dockerfile")
            if not dockerfile.is_file():
                problems.append(f"{where}: build dockerfile {dockerfile} does not exist")
            elif build.get("target") and not re.search(
                    rf"^FROM\s+\S+\s+AS\s+{re.escape(build['target'])}\s*$",
                    dockerfile.read_text(encoding="utf-8"), re.MULTILINE | re.IGNORECASE):
                problems.append(f"{where}: build target {build['target']} is not a stage")
        depends = service.get("depends_on") or {}
        if isinstance(depends, list):
            depends = {target: {"condition": "service_started"} for target in depends}
        for target, options in depends.items():
            if target not in services:
                problems.append(f"{where}: depends_on unknown service {target}")
                continue
            condition = (options or {}).get("condition", "service_started")
            if condition == "service_healthy" and "healthcheck" not in services[target]:
                problems.append(f"{where}: waits for {target} to be healthy, it has no healthcheck")
            if condition == "service_completed_successfully" and \
                    services[target].get("restart", "no") not in ("no", False):
                problems.append(f"{where}: waits for {target} to complete, but it restarts")
        for volume in service.get("volumes") or []:
            source = volume.split(":", 1)[0] if isinstance(volume, str) else volume.get("source")
            if not source:
                continue
            if source.startswith((".", "/", "~")):
                if not (path.parent / source).exists():
                    problems.append(f"{where}: bind mount source {source} does not exist")
            elif source not in volumes:
                problems.append(f"{where}: named volume {source} is not declared")
        for ports in service.get("ports") or []:
            if isinstance(ports, str) and not ports.startswith("127.0.0.1:"):
                problems.append(f"{where}: port {ports} is published on every interface")
        # TLS: every PEM file a variable names is in one of the service's mounts, and a TLS
        # api-server's healthcheck is its own health check (a TCP connect proves no handshake).
        environment = service.get("environment") or {}
        if isinstance(environment, list):
            environment = dict(item.split("=", 1) if "=" in item else (item, None)
                               for item in environment)
        environment = {k: str(v) for k, v in environment.items() if v is not None}
        targets = [(volume.split(":")[1] if isinstance(volume, str) and ":" in volume
                    else (volume or {}).get("target") if isinstance(volume, dict) else None)
                   for volume in service.get("volumes") or []]
        for what, file in tls_file_references({}, environment):
            if not any(target and file.startswith(target.rstrip("/") + "/") for target in targets):
                problems.append(f"{where}: {what} names {file}, which none of its volumes holds")
        if environment.get("GRPC_TLS_CERT"):
            test = (service.get("healthcheck") or {}).get("test") or []
            if "health-check" not in (test if isinstance(test, list) else test.split()):
                problems.append(f"{where}: serves TLS (GRPC_TLS_CERT) but its healthcheck is not "
                                "`api-server health-check`")
    # No cycles in depends_on.
    state: dict[str, int] = {}

    def visit(name: str, trail: list[str]) -> None:
        if state.get(name) == 1:
            problems.append(f"{path}: depends_on cycle {' -> '.join(trail + [name])}")
            return
        if state.get(name) == 2:
            return
        state[name] = 1
        for target in (services[name].get("depends_on") or {}):
            if target in services:
                visit(target, trail + [name])
        state[name] = 2

    for name in services:
        visit(name, [])
    return problems


# ------------------------------------------------------------------------------------------------
# OpenTelemetry Collector

def collector(path: Path) -> list[str]:
    problems: list[str] = []
    (doc,) = load_all(path)
    service = doc.get("service") or {}
    for extension in service.get("extensions") or []:
        if extension not in (doc.get("extensions") or {}):
            problems.append(f"{path}: service extension {extension} is not defined")
    pipelines = service.get("pipelines") or {}
    if not pipelines:
        problems.append(f"{path}: no pipelines")
    for name, pipeline in pipelines.items():
        if name.split("/")[0] not in ("traces", "metrics", "logs"):
            problems.append(f"{path}: pipeline {name}: unknown signal")
        for section in ("receivers", "processors", "exporters"):
            for component in pipeline.get(section) or []:
                if component not in (doc.get(section) or {}):
                    problems.append(f"{path}: pipeline {name}: {section[:-1]} {component} "
                                    "is not defined")
        if not pipeline.get("receivers") or not pipeline.get("exporters"):
            problems.append(f"{path}: pipeline {name} needs receivers and exporters")
    return problems


# ------------------------------------------------------------------------------------------------
# Dockerfile

def workspace_members(root: Path) -> list[str]:
    text = (root / "Cargo.toml").read_text(encoding="utf-8")
    match = re.search(r"^members\s*=\s*\[(.*?)\]", text, re.MULTILINE | re.DOTALL)
    if not match:
        raise Problem("Cargo.toml: no [workspace] members")
    return re.findall(r'"([^"]+)"', match.group(1))


def dockerfile(path: Path, root: Path) -> list[str]:
    problems: list[str] = []
    text = path.read_text(encoding="utf-8")
    lines = [line.strip() for line in re.sub(r"\\\n", " ", text).splitlines()]
    stages: dict[str, list[str]] = {}
    current = None
    for line in lines:
        match = re.match(r"FROM\s+(\S+)(?:\s+AS\s+(\S+))?$", line, re.IGNORECASE)
        if match:
            current = match.group(2) or f"#{len(stages)}"
            stages[current] = [line]
        elif current and line and not line.startswith("#"):
            stages[current].append(line)
    copied = set()
    for line in stages.get("builder", []):
        match = re.match(r"COPY\s+(?!--from)(.+)$", line, re.IGNORECASE)
        if match:
            copied.update(part.rstrip("/") for part in match.group(1).split()[:-1])
    needed = set(workspace_members(root)) | {"Cargo.toml", "Cargo.lock", "migrations"}
    for item in sorted(needed - copied):
        problems.append(f"{path}: the builder does not COPY {item}")
    for item in sorted(copied - {"."}):
        if not (root / item).exists():
            problems.append(f"{path}: COPY {item}: no such file or directory in the repository")
    ignore = root / ".dockerignore"
    patterns = [line.strip() for line in ignore.read_text(encoding="utf-8").splitlines()
                if line.strip() and not line.startswith("#")] if ignore.exists() else []
    for item in sorted(needed):
        excluded = False
        for pattern in patterns:
            negated = pattern.startswith("!")
            bare = pattern.lstrip("!").rstrip("/").lstrip("/")
            if fnmatch.fnmatch(item, bare) or (bare.startswith("**/")
                                               and fnmatch.fnmatch(item, bare[3:])):
                excluded = not negated
        if excluded:
            problems.append(f"{ignore}: excludes {item}, which the build needs")
    for target, binary in (("api-server", "api-server"), ("workers", "workers"),
                           ("fake-stripe", "fake-stripe"), ("mail-sink", "mail-sink")):
        if target not in stages:
            problems.append(f"{path}: no stage {target}")
            continue
        chain, stage = [], target
        while stage in stages:  # follow FROM <stage> to the base image
            chain.append(stage)
            parent = stages[stage][0].split()[1]
            stage = parent if parent in stages else None
        users = [line.split()[1] for s in chain for line in stages[s]
                 if line.upper().startswith("USER ")]
        if not users or users[0].split(":")[0] in ("root", "0"):
            problems.append(f"{path}: stage {target} does not run as a non-root user")
        if not any(line.upper().startswith("ENTRYPOINT") and binary in line
                   for line in stages[target]):
            problems.append(f"{path}: stage {target} has no ENTRYPOINT running {binary}")
        if any(re.search(r"\b(cargo|rustc|gcc|build-essential)\b", line)
               for s in chain for line in stages[s][1:]):
            problems.append(f"{path}: stage {target} contains build tools")
    if "--locked" not in text:
        problems.append(f"{path}: cargo build without --locked")
    return problems


# ------------------------------------------------------------------------------------------------

def dump(objects: list[dict]) -> str:
    return "---\n".join(yaml.safe_dump(obj, sort_keys=True, default_flow_style=False)
                        for obj in objects)


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    command, args = argv[1], [Path(arg) for arg in argv[2:]]
    try:
        if command == "render":
            sys.stdout.write(dump(finish(build(args[0]))))
            return 0
        if command == "same":
            first, second = (canonical(load_all(path)) for path in args)
            if first == second:
                return 0
            only_first = sorted(set(first) - set(second))
            only_second = sorted(set(second) - set(first))
            for text in only_first[:3]:
                print(f"only in {args[0]}: {text[:400]}", file=sys.stderr)
            for text in only_second[:3]:
                print(f"only in {args[1]}: {text[:400]}", file=sys.stderr)
            return 1
        problems = {
            "k8s-policy": lambda: k8s_policy(args),
            "custom-resources": lambda: custom_resources(args[0], args[1:]),
            "compose": lambda: compose(args[0]),
            "collector": lambda: collector(args[0]),
            "dockerfile": lambda: dockerfile(args[0], args[1]),
        }[command]()
    except (Problem, OSError, yaml.YAMLError, KeyError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
