//! capture-cni's stdin, read the way the plugin reads it for each operation: rscni decodes the
//! network configuration and negotiates the version (every version it supports: 0.3.0 to
//! 1.1.0), then capture-cni reads its own keys, prevResult and runtimeConfig's pod annotations.

#![no_main]

use capture_cni::plugin::{
    add_input, check_input, gc_valid_container_ids, plugin_config, AddInput,
};
use libfuzzer_sys::fuzz_target;
use rscni_plugin::{
    error::Error,
    test_util::ArgsBuilder,
    types::{Args, CNIResultWithVersion, Cmd},
    version::PluginInfo,
};

const CNI_ARGS: &str = "IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME=web-0;\
                        K8S_POD_UID=2f1c6b1e-7d0a-4c55-9a4e-0d9b8a2c1f00;\
                        K8S_POD_INFRA_CONTAINER_ID=c0ffee";

/// The arguments rscni hands the plugin for `cmd`: the environment it reads for that operation,
/// and the configuration from `stdin`.
fn args(cmd: Cmd, stdin: &str) -> Result<Args, Error> {
    let builder = match cmd {
        Cmd::Add | Cmd::Del | Cmd::Check => ArgsBuilder::new()
            .container_id("c0ffee")?
            .netns("/var/run/netns/cni-5b3d")
            .ifname("eth0")?
            .args(CNI_ARGS)
            .path("/opt/cni/bin"),
        _ => ArgsBuilder::new().path("/opt/cni/bin"),
    };
    builder.config(stdin)?.build()
}

/// What capture-cni makes of its input for `cmd`, short of talking to the agent; errors by code
/// and text.
#[derive(Debug, PartialEq)]
enum Read {
    Add(Box<AddInput>),
    Check(String),
    Config(String),
    Gc(String, Vec<String>),
}

fn read(cmd: Cmd, args: &Args) -> Result<Read, (u32, String)> {
    let version = PluginInfo::default()
        .negotiate(args.config(), cmd)
        .map_err(|e| (u32::from(&e), e.to_string()))?;
    let result = match cmd {
        Cmd::Add => {
            if !version.is_supported() {
                return Err((1, "unsupported result version".into()));
            }
            add_input(args).map(|input| {
                check_result(version, &input);
                Read::Add(Box::new(input))
            })
        }
        Cmd::Check => check_input(args).map(|c| Read::Check(format!("{c:?}"))),
        Cmd::Gc => {
            plugin_config(args).map(|c| Read::Gc(format!("{c:?}"), gc_valid_container_ids(args)))
        }
        _ => plugin_config(args).map(|c| Read::Config(format!("{c:?}"))),
    };
    result.map_err(|e| (u32::from(&e), e.to_string()))
}

/// ADD answers with prevResult, in the layout of the negotiated version: it must serialise, and
/// a runtime of that version must be able to read it.
fn check_result(version: rscni_plugin::version::SpecVersion, input: &AddInput) {
    if version.is_legacy() {
        let legacy = rscni_types::legacy::CNIResult::new(version, input.prev.clone());
        let out = serde_json::to_value(&legacy).expect("legacy results serialise");
        let ips = out
            .get("ips")
            .and_then(|v| v.as_array())
            .map_or(0, Vec::len);
        assert_eq!(ips, input.prev.ips.len(), "addresses lost in {out}");
    } else {
        let out = serde_json::to_string(&CNIResultWithVersion::new(version, input.prev.clone()))
            .expect("results serialise");
        let back: CNIResultWithVersion = serde_json::from_str(&out)
            .unwrap_or_else(|e| panic!("the ADD result does not read back ({e}): {out}"));
        assert_eq!(
            back.result().ips,
            input.prev.ips,
            "addresses changed in {out}"
        );
    }
}

fn without_empty_dns(read: Read) -> Read {
    match read {
        Read::Add(mut input) => {
            if input.prev.dns.as_ref().is_some_and(|d| {
                d.nameservers.is_empty()
                    && d.domain.as_ref().is_none_or(String::is_empty)
                    && d.search.as_ref().is_none_or(Vec::is_empty)
                    && d.options.as_ref().is_none_or(Vec::is_empty)
            }) {
                input.prev.dns = None;
            }
            Read::Add(input)
        }
        other => other,
    }
}

fuzz_target!(|data: &[u8]| {
    // rscni reads stdin to a String: anything but UTF-8 is an I/O error before any parsing.
    let Ok(stdin) = std::str::from_utf8(data) else {
        return;
    };
    for cmd in [Cmd::Add, Cmd::Del, Cmd::Check, Cmd::Status, Cmd::Gc] {
        let Ok(args) = args(cmd, stdin) else {
            continue;
        };
        let first = read(cmd, &args);
        // What rscni decoded, written out and read again, is the same input to capture-cni. An
        // empty prevResult.dns is written as none (as the reference implementation does): the
        // same result.
        let text = serde_json::to_string(args.config()).expect("configurations serialise");
        let again = self::args(cmd, &text)
            .unwrap_or_else(|e| panic!("a decoded configuration is refused ({e}): {text}"));
        // As values: rscni keeps maps in hash maps, whose order changes from one to the next.
        assert_eq!(
            serde_json::to_value(again.config()).expect("configurations serialise"),
            serde_json::to_value(args.config()).expect("configurations serialise"),
            "the configuration changed"
        );
        assert_eq!(
            read(cmd, &again),
            first.map(without_empty_dns),
            "{cmd:?} reads it otherwise: {text}"
        );
    }
});
