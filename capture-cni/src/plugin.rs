//! `capture-cni`: the CNI operations. Every capture decision is the agent's; the plugin finds
//! the pod (identity, addresses, annotations, cgroup) and fails closed when it cannot get the
//! agent to capture a pod that needs it.

use std::{collections::BTreeMap, net::IpAddr, path::PathBuf, time::Duration};

use rscni_plugin::{
    cni::Cni,
    error::Error,
    types::{Args, CNIResult},
};

use capture_model::{
    api::{self, CallError, FailureKind, PodRequest, Request, Response},
    claims,
    cni::{parse_cni_args, skip_reason, K8sArgs, PluginConfig, Skip, POD_ANNOTATIONS_CAPABILITY},
    left_alone,
    record::PodRef,
};
use capture_sys::{
    paths::{Paths, DEFAULT_BPFFS_DIR},
    pod_cgroup::{find_on_node, find_pod_cgroup},
};

/// Plugin-defined CNI error codes (the spec reserves 100+ for plugins).
pub const CODE_CAPTURE_FAILED: u32 = 100;
pub const CODE_NOT_IN_FORCE: u32 = 101;
pub const CODE_NO_POD_CGROUP: u32 = 102;

pub struct CapturePlugin {
    /// When this process started ([`api::plugin_clock_ns`]), sent with ADD.
    pub started_ns: Option<u64>,
}

impl CapturePlugin {
    /// The plugin of a process that starts now: made first thing in `main`.
    #[must_use]
    pub fn starting() -> Self {
        Self {
            started_ns: api::plugin_clock_ns(),
        }
    }
}

/// capture-cni's own keys of its conflist entry, from the stdin configuration.
pub fn plugin_config(args: &Args) -> Result<PluginConfig, Error> {
    // In key order: rscni's map is a hash map, and which unknown key the error names must not
    // change from one run to the next.
    let custom: BTreeMap<&String, &serde_json::Value> = args.config().custom.iter().collect();
    let value = serde_json::Value::Object(
        custom
            .into_iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect(),
    );
    serde_json::from_value(value).map_err(|e| {
        Error::InvalidNetworkConfig(format!(
            "capture-cni configuration: {e} (known keys: agent_socket, exclude_namespaces, cgroup_root, timeout_seconds, state_dir)"
        ))
    })
}

fn container_id(args: &Args) -> Result<String, Error> {
    args.container_id()
        .map(ToString::to_string)
        .ok_or_else(|| Error::InvalidEnvValue("CNI_CONTAINERID is not set".into()))
}

/// The pod's annotations from the runtime's capability. Absent means the runtime was not asked
/// for them: capture could not tell a meshed pod from another, so that is an error. `null` is a
/// pod without annotations: containerd passes its pod's annotation map as it is, and an empty
/// one is nil in Go.
pub fn pod_annotations(args: &Args) -> Result<BTreeMap<String, String>, Error> {
    let missing = || {
        Error::InvalidNetworkConfig(format!(
            "the runtime passed no pod annotations; give capture-cni's conflist entry \"capabilities\": {{\"{POD_ANNOTATIONS_CAPABILITY}\": true}}"
        ))
    };
    let rc = args.config().runtime_config.as_ref().ok_or_else(missing)?;
    let raw = rc
        .custom
        .get(POD_ANNOTATIONS_CAPABILITY)
        .ok_or_else(missing)?;
    if raw.is_null() {
        return Ok(BTreeMap::new());
    }
    serde_json::from_value(raw.clone()).map_err(|e| {
        Error::FailedToDecode(format!("runtimeConfig {POD_ANNOTATIONS_CAPABILITY}: {e}"))
    })
}

fn call(cfg: &PluginConfig, request: &Request) -> Result<Response, Error> {
    api::call(
        &cfg.agent_socket,
        request,
        Duration::from_secs(cfg.timeout_seconds),
    )
    .map_err(|e| match e {
        CallError::NotSocket { .. } => Error::InvalidNetworkConfig(e.to_string()),
        _ => Error::TryAgainLater(e.to_string()),
    })
}

fn failure(response: Response, code_for_capture: u32, what: &str) -> Error {
    let msg = response.error.unwrap_or_else(|| "no reason given".into());
    match response.kind {
        Some(FailureKind::NotReady) => Error::TryAgainLater(msg),
        Some(FailureKind::InvalidConfig) => Error::InvalidNetworkConfig(msg),
        _ => Error::Custom(code_for_capture, what.into(), msg),
    }
}

/// DEL while the agent cannot be reached: a container capture never claimed (not meshed, or
/// its ADD never got to the agent) is deleted at once; one it may have captured waits for the
/// agent, the only one that can release it, so that nothing of it is left in the kernel.
fn del_without_agent(cfg: &PluginConfig, container_id: &str, why: String) -> Result<(), Error> {
    let paths = Paths::new(DEFAULT_BPFFS_DIR, &cfg.state_dir);
    match claims::is_claimed(&paths, container_id) {
        Ok(false) => {
            eprintln!(
                "capture-cni: {why}; container {container_id} was never captured, nothing to release"
            );
            Ok(())
        }
        Ok(true) => Err(Error::TryAgainLater(format!(
            "{why}; container {container_id} is captured and only the capture agent can release it"
        ))),
        Err(e) => Err(Error::TryAgainLater(format!(
            "{why}; cannot tell whether container {container_id} was captured ({}: {e})",
            cfg.state_dir.display()
        ))),
    }
}

/// The longest a report of a pod left alone may hold up its ADD.
const REPORT_TIMEOUT: Duration = Duration::from_secs(2);

/// Tells the agent about a pod Istio injected that capture leaves alone, for its status and
/// metrics. Best effort: the pod needs nothing from capture, so an agent that is down, slow or
/// too old to know the request costs the report only.
fn report_left_alone(
    cfg: &PluginConfig,
    args: &Args,
    k8s: K8sArgs,
    reason: left_alone::Reason,
    skip: &Skip,
) {
    let report = left_alone::LeftAlone {
        pod: PodRef {
            namespace: k8s.namespace,
            name: k8s.name,
            uid: k8s.uid,
            container_id: container_id(args).unwrap_or_default(),
        },
        netns: args.netns().cloned(),
        reason,
        detail: skip.to_string(),
        reported_at_unix: 0,
    };
    let timeout = REPORT_TIMEOUT.min(Duration::from_secs(cfg.timeout_seconds));
    match api::call(&cfg.agent_socket, &Request::LeftAlone { report }, timeout) {
        Ok(r) if r.ok => {}
        Ok(r) => eprintln!(
            "capture-cni: the agent did not record the pod as left alone: {}",
            r.error.unwrap_or_default()
        ),
        Err(e) => eprintln!("capture-cni: cannot report the pod as left alone: {e}"),
    }
}

/// What ADD reads from its input (stdin's configuration and prevResult, `CNI_ARGS`, the
/// runtime's capabilities) before it looks at the node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AddInput {
    pub cfg: PluginConfig,
    /// The previous plugin's result, which ADD passes on unchanged.
    pub prev: CNIResult,
    pub k8s: K8sArgs,
    pub annotations: BTreeMap<String, String>,
    /// Why the pod is left alone, if it is.
    pub skip: Option<Skip>,
    /// The pod's addresses, from prevResult.
    pub pod_ips: Vec<IpAddr>,
}

pub fn add_input(args: &Args) -> Result<AddInput, Error> {
    let cfg = plugin_config(args)?;
    let prev = args.config().prev_result.clone().ok_or_else(|| {
        Error::InvalidNetworkConfig(
            "no prevResult: capture-cni is a chained plugin and must come after the pod network plugin in the conflist".into(),
        )
    })?;
    let k8s = parse_cni_args(args.args()).map_err(Error::InvalidEnvValue)?;
    let annotations = pod_annotations(args)?;
    let skip = skip_reason(&cfg, &k8s, &annotations);
    let pod_ips = pod_addresses(&prev)?;
    Ok(AddInput {
        cfg,
        prev,
        k8s,
        annotations,
        skip,
        pod_ips,
    })
}

/// The pod's addresses in prevResult's order (the network plugin lists the primary interface's
/// first). An address on an interface prevResult does not list, or on one outside the pod's
/// netns (the host end of a veth), is not the pod's: the result is refused, naming it.
fn pod_addresses(prev: &CNIResult) -> Result<Vec<IpAddr>, Error> {
    prev.ips
        .iter()
        .map(|ip| {
            let addr = ip.address.addr();
            let Some(i) = ip.interface else {
                return Ok(addr);
            };
            match prev.interfaces.get(i as usize) {
                None => Err(Error::InvalidNetworkConfig(format!(
                    "prevResult gives the pod address {addr} on interface {i}, but lists {} interface(s): the network plugin's result is inconsistent",
                    prev.interfaces.len()
                ))),
                Some(nic) if nic.sandbox.as_deref().is_none_or(str::is_empty) => {
                    Err(Error::InvalidNetworkConfig(format!(
                        "prevResult gives the pod address {addr} on interface {}, which is not in the pod's network namespace (no sandbox)",
                        nic.name
                    )))
                }
                Some(_) => Ok(addr),
            }
        })
        .collect()
}

/// What CHECK reads from its input: the plugin's keys, the pod, and why it is left alone.
pub fn check_input(args: &Args) -> Result<(PluginConfig, K8sArgs, Option<Skip>), Error> {
    let cfg = plugin_config(args)?;
    let k8s = parse_cni_args(args.args()).map_err(Error::InvalidEnvValue)?;
    let skip = skip_reason(&cfg, &k8s, &pod_annotations(args)?);
    Ok((cfg, k8s, skip))
}

/// The container ids GC must keep (`cni.dev/valid-attachments`).
#[must_use]
pub fn gc_valid_container_ids(args: &Args) -> Vec<String> {
    args.config()
        .valid_attachments
        .as_ref()
        .map(|v| v.iter().map(|a| a.container_id.clone()).collect())
        .unwrap_or_default()
}

impl Cni for CapturePlugin {
    fn add(&self, args: Args) -> Result<CNIResult, Error> {
        let AddInput {
            cfg,
            prev,
            k8s,
            annotations,
            skip,
            pod_ips,
        } = add_input(&args)?;
        if let Some(skip) = skip {
            eprintln!(
                "capture-cni: not capturing {}/{}: {skip}",
                k8s.namespace, k8s.name
            );
            if let Some(reason) = skip.left_alone_reason(&annotations) {
                report_left_alone(&cfg, &args, k8s, reason, &skip);
            }
            return Ok(prev);
        }
        let netns: PathBuf = args
            .netns()
            .cloned()
            .ok_or_else(|| Error::InvalidEnvValue("CNI_NETNS is not set".into()))?;
        let cgroup = match &cfg.cgroup_root {
            Some(root) => find_pod_cgroup(root, &k8s.uid),
            None => find_on_node(&k8s.uid),
        }
        .map_err(|e| Error::Custom(CODE_NO_POD_CGROUP, "no pod cgroup".into(), e))?;
        if pod_ips.is_empty() {
            return Err(Error::InvalidNetworkConfig(
                "prevResult has no IP addresses for the pod".into(),
            ));
        }
        let pod = PodRef {
            namespace: k8s.namespace,
            name: k8s.name,
            uid: k8s.uid,
            container_id: container_id(&args)?,
        };
        let response = call(
            &cfg,
            &Request::Add {
                pod: PodRequest {
                    netns,
                    cgroup,
                    pod_ips,
                    annotations,
                    pod,
                    labels: None,
                },
                plugin_started_ns: self.started_ns,
            },
        )?;
        if response.ok {
            Ok(prev)
        } else {
            Err(failure(response, CODE_CAPTURE_FAILED, "capture failed"))
        }
    }

    fn del(&self, args: Args) -> Result<(), Error> {
        let cfg = plugin_config(&args)?;
        let container_id = container_id(&args)?;
        let request = Request::Del {
            container_id: container_id.clone(),
            netns: args.netns().cloned(),
        };
        let response = match call(&cfg, &request) {
            Ok(response) => response,
            Err(Error::TryAgainLater(why)) => return del_without_agent(&cfg, &container_id, why),
            Err(e) => return Err(e),
        };
        if response.ok {
            Ok(())
        } else {
            Err(failure(response, CODE_CAPTURE_FAILED, "release failed"))
        }
    }

    fn check(&self, args: Args) -> Result<(), Error> {
        let (cfg, k8s, skip) = check_input(&args)?;
        if let Some(reason) = skip {
            eprintln!(
                "capture-cni: {}/{} is not captured by design: {reason}",
                k8s.namespace, k8s.name
            );
            return Ok(());
        }
        let response = call(
            &cfg,
            &Request::Check {
                container_id: container_id(&args)?,
            },
        )?;
        if response.ok {
            Ok(())
        } else {
            Err(failure(response, CODE_NOT_IN_FORCE, "capture not in force"))
        }
    }

    fn status(&self, args: Args) -> Result<(), Error> {
        let cfg = plugin_config(&args)?;
        match api::call(
            &cfg.agent_socket,
            &Request::Status,
            Duration::from_secs(cfg.timeout_seconds),
        ) {
            Ok(r) if r.ok => Ok(()),
            Ok(r) => Err(Error::PluginNotAvailable(r.error.unwrap_or_default())),
            Err(e) => Err(Error::PluginNotAvailable(e.to_string())),
        }
    }

    fn gc(&self, args: Args) -> Result<(), Error> {
        let cfg = plugin_config(&args)?;
        let response = call(
            &cfg,
            &Request::Gc {
                valid_container_ids: gc_valid_container_ids(&args),
            },
        )?;
        if response.ok {
            Ok(())
        } else {
            Err(failure(response, CODE_CAPTURE_FAILED, "gc failed"))
        }
    }
}

#[cfg(test)]
mod tests {
    use rscni_plugin::test_util::ArgsBuilder;

    use super::*;

    fn args(stdin: &str) -> Args {
        ArgsBuilder::new()
            .container_id("c0ffee")
            .unwrap()
            .netns("/var/run/netns/cni-1")
            .ifname("eth0")
            .unwrap()
            .args("K8S_POD_NAMESPACE=ns;K8S_POD_NAME=p;K8S_POD_UID=u")
            .config(stdin)
            .unwrap()
            .build()
            .unwrap()
    }

    fn prev(ips: &str) -> CNIResult {
        let result = format!(
            r#"{{"cniVersion":"1.0.0","interfaces":[
                {{"name":"veth1","mac":"00:00:00:00:00:01"}},
                {{"name":"eth0","sandbox":"/var/run/netns/cni-1"}},
                {{"name":"net1","sandbox":"/var/run/netns/cni-1"}}],"ips":[{ips}]}}"#
        );
        serde_json::from_str(&result).unwrap()
    }

    #[test]
    fn a_second_network_gives_the_pod_more_addresses() {
        let two = prev(
            r#"{"address":"10.1.0.10/24","interface":1},{"address":"192.168.7.2/24","interface":2},
               {"address":"fd00::10/64","interface":1},{"address":"10.9.0.1/32"}"#,
        );
        let ips: Vec<String> = pod_addresses(&two)
            .unwrap()
            .iter()
            .map(ToString::to_string)
            .collect();
        assert_eq!(ips, ["10.1.0.10", "192.168.7.2", "fd00::10", "10.9.0.1"]);
    }

    #[test]
    fn an_address_outside_the_pods_interfaces_is_refused_by_name() {
        for (ips, words) in [
            (
                r#"{"address":"10.1.0.10/24","interface":0}"#,
                ["10.1.0.10", "veth1"],
            ),
            (
                r#"{"address":"10.1.0.11/24","interface":7}"#,
                ["10.1.0.11", "interface 7"],
            ),
        ] {
            let e = pod_addresses(&prev(ips)).unwrap_err().to_string();
            assert!(words.iter().all(|w| e.contains(w)), "{e}");
        }
    }

    /// Found by the `cni_stdin` fuzz target: with two unknown keys, the one the error named
    /// changed from run to run.
    #[test]
    fn unknown_keys_are_reported_the_same_every_time() {
        let stdin = r#"{"cniVersion":"1.0.0","name":"n","type":"capture-cni","zz_key":1,"agentSocket":"/x","caparilities":{}}"#;
        for _ in 0..32 {
            let e = plugin_config(&args(stdin)).unwrap_err().to_string();
            assert!(e.contains("unknown field `agentSocket`"), "{e}");
        }
    }
}
