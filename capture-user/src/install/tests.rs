use super::*;

const SOCKET: &str = "/run/capture/agent.sock";

fn fixtures() -> Vec<(&'static str, &'static str)> {
    vec![
        (
            "10-containerd-net.conflist",
            include_str!("testdata/10-containerd-net.conflist"),
        ),
        (
            "10-calico.conflist",
            include_str!("testdata/10-calico.conflist"),
        ),
        (
            "10-flannel.conflist",
            include_str!("testdata/10-flannel.conflist"),
        ),
        (
            "05-cilium.conflist",
            include_str!("testdata/05-cilium.conflist"),
        ),
        (
            "10-kindnet.conflist",
            include_str!("testdata/10-kindnet.conflist"),
        ),
        ("10-aws.conflist", include_str!("testdata/10-aws.conflist")),
    ]
}

/// The text with capture-cni chained, where istio-cni is not.
fn insert_into(path: &Path, text: &str, entry: &Value) -> Result<String, InstallError> {
    chain_text(path, text, entry, false).map(|(text, _)| text)
}

fn json(text: &str) -> Value {
    serde_json::from_str(text).unwrap()
}

#[test]
fn chains_last_and_keeps_everything_else() {
    for (name, text) in fixtures() {
        let path = Path::new(name);
        let out = insert_into(path, text, &plugin_entry(Path::new(SOCKET), None)).unwrap();
        let (before, after) = (json(text), json(&out));
        let (pb, pa) = (
            before["plugins"].as_array().unwrap(),
            after["plugins"].as_array().unwrap(),
        );
        assert_eq!(pa.len(), pb.len() + 1, "{name}");
        assert_eq!(&pa[..pb.len()], &pb[..], "{name}: other plugins changed");
        assert_eq!(
            pa.last().unwrap(),
            &plugin_entry(Path::new(SOCKET), None),
            "{name}"
        );
        for key in before
            .as_object()
            .unwrap()
            .keys()
            .filter(|k| *k != "plugins")
        {
            assert_eq!(before[key], after[key], "{name}: {key} changed");
        }
        let keys = |v: &Value| v.as_object().unwrap().keys().cloned().collect::<Vec<_>>();
        assert_eq!(keys(&before), keys(&after), "{name}: key order changed");
        assert_eq!(
            detect_indent(&out),
            detect_indent(text),
            "{name}: indentation changed"
        );
        assert_eq!(
            out.ends_with('\n'),
            text.ends_with('\n'),
            "{name}: final newline"
        );
        // Idempotent: installing again changes nothing.
        assert_eq!(
            insert_into(path, &out, &plugin_entry(Path::new(SOCKET), None)).unwrap(),
            out,
            "{name}: second install"
        );
        // Uninstall gives the original configuration back.
        let back = remove_from(path, &out)
            .unwrap()
            .expect("capture entry removed");
        assert_eq!(json(&back), before, "{name}: uninstall");
        assert!(
            remove_from(path, &back).unwrap().is_none(),
            "{name}: second uninstall"
        );
    }
}

#[test]
fn canonical_files_round_trip_byte_for_byte() {
    for (name, text) in fixtures()
        .into_iter()
        .filter(|(n, _)| *n != "10-kindnet.conflist")
    {
        let path = Path::new(name);
        let out = insert_into(path, text, &plugin_entry(Path::new(SOCKET), None)).unwrap();
        assert_eq!(remove_from(path, &out).unwrap().unwrap(), text, "{name}");
    }
}

#[test]
fn tabs_stay_tabs() {
    let out = insert_into(
        Path::new("k"),
        include_str!("testdata/10-kindnet.conflist"),
        &plugin_entry(Path::new(SOCKET), None),
    )
    .unwrap();
    assert!(out.lines().nth(1).unwrap().starts_with('\t'), "{out}");
}

#[test]
fn a_moved_or_changed_entry_is_updated_not_duplicated() {
    let text = include_str!("testdata/10-flannel.conflist");
    let old = insert_into(
        Path::new("f"),
        text,
        &plugin_entry(Path::new("/old.sock"), None),
    )
    .unwrap();
    let mut v = json(&old);
    let plugins = v["plugins"].as_array_mut().unwrap();
    let ours = plugins.pop().unwrap();
    plugins.insert(0, ours);
    let shuffled = serde_json::to_string_pretty(&v).unwrap();
    let out = json(
        &insert_into(
            Path::new("f"),
            &shuffled,
            &plugin_entry(Path::new(SOCKET), None),
        )
        .unwrap(),
    );
    let plugins = out["plugins"].as_array().unwrap();
    assert_eq!(plugins.iter().filter(|p| is_capture(p)).count(), 1);
    assert_eq!(plugins.last().unwrap()["agent_socket"], SOCKET);
}

#[test]
fn a_single_plugin_conf_becomes_a_conflist() {
    let text = include_str!("testdata/10-bridge.conf");
    let out = json(
        &insert_into(
            Path::new("10-bridge.conf"),
            text,
            &plugin_entry(Path::new(SOCKET), None),
        )
        .unwrap(),
    );
    assert_eq!(out["name"], "bridge");
    assert_eq!(out["cniVersion"], "0.4.0");
    let plugins = out["plugins"].as_array().unwrap();
    assert_eq!(plugins[0]["type"], "bridge");
    assert!(is_capture(&plugins[1]));
}

#[test]
fn bad_configurations_are_named() {
    let e = insert_into(
        Path::new("/etc/cni/net.d/x.conflist"),
        "{ nope",
        &plugin_entry(Path::new(SOCKET), None),
    )
    .unwrap_err();
    assert!(e.to_string().contains("/etc/cni/net.d/x.conflist"), "{e}");
    let e = insert_into(
        Path::new("y"),
        r#"{"plugins": []}"#,
        &plugin_entry(Path::new(SOCKET), None),
    )
    .unwrap_err();
    assert!(e.to_string().contains("empty"), "{e}");
}

#[test]
fn install_and_uninstall_on_a_directory() {
    let root = std::env::temp_dir().join(format!("capture-install-{}", std::process::id()));
    let (bin, conf) = (root.join("bin"), root.join("net.d"));
    fs::create_dir_all(&bin).unwrap();
    fs::create_dir_all(&conf).unwrap();
    fs::write(
        conf.join("10-calico.conflist"),
        include_str!("testdata/10-calico.conflist"),
    )
    .unwrap();
    fs::write(
        conf.join("20-other.conflist"),
        include_str!("testdata/10-flannel.conflist"),
    )
    .unwrap();
    fs::write(conf.join("calico-kubeconfig"), "not a network config").unwrap();
    let plugin = root.join("capture-cni-build");
    fs::write(&plugin, b"#!/bin/true\n").unwrap();
    let opts = InstallOptions {
        cni_bin_dir: bin.clone(),
        cni_conf_dir: conf.clone(),
        conf_file: None,
        plugin_binary: plugin,
        agent_socket: SOCKET.into(),
        state_dir: None,
        replace_istio_cni: false,
    };
    let first = install(&opts).unwrap();
    assert_eq!(
        first.config,
        conf.join("10-calico.conflist"),
        "the first config by name is the active one"
    );
    assert!(first.config_changed && first.binary_changed);
    let again = install(&opts).unwrap();
    assert!(
        !again.config_changed && !again.binary_changed,
        "install is idempotent"
    );
    assert_eq!(
        fs::read_to_string(conf.join("20-other.conflist")).unwrap(),
        include_str!("testdata/10-flannel.conflist")
    );
    assert!(!fs::read_dir(&conf)
        .unwrap()
        .flatten()
        .any(|e| e.file_name().to_string_lossy().contains("tmp")));
    assert_eq!(
        uninstall(&opts).unwrap(),
        vec![conf.join("10-calico.conflist")]
    );
    assert_eq!(
        fs::read_to_string(conf.join("10-calico.conflist")).unwrap(),
        include_str!("testdata/10-calico.conflist")
    );
    assert!(!bin.join(PLUGIN_TYPE).exists());
    assert!(
        uninstall(&opts).unwrap().is_empty(),
        "uninstall is idempotent"
    );
    let empty = root.join("empty");
    fs::create_dir_all(&empty).unwrap();
    let e = install(&InstallOptions {
        cni_conf_dir: empty,
        ..opts
    })
    .unwrap_err();
    assert!(
        e.to_string().contains("no CNI network configuration"),
        "{e}"
    );
    fs::remove_dir_all(&root).unwrap();
}

#[test]
fn the_entry_names_a_state_dir_only_when_it_is_not_the_default() {
    let socket = Path::new(SOCKET);
    assert!(plugin_entry(socket, None).get("state_dir").is_none());
    assert!(plugin_entry(socket, Some(Path::new(DEFAULT_STATE_DIR)))
        .get("state_dir")
        .is_none());
    assert_eq!(
        plugin_entry(socket, Some(Path::new("/var/lib/capture")))["state_dir"],
        "/var/lib/capture"
    );
}

/// A node where Istio's install-cni chained istio-cni after Calico.
const WITH_ISTIO_CNI: &str = include_str!("testdata/10-calico-istio-cni.conflist");

struct ConfDir(PathBuf);

impl ConfDir {
    fn new(name: &str, config: &str) -> Self {
        let root = std::env::temp_dir().join(format!("capture-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&root);
        fs::create_dir_all(root.join("net.d")).unwrap();
        fs::create_dir_all(root.join("bin")).unwrap();
        fs::write(root.join("net.d/10-calico.conflist"), config).unwrap();
        fs::write(root.join("capture-cni-build"), b"#!/bin/true\n").unwrap();
        Self(root)
    }

    fn opts(&self, replace_istio_cni: bool) -> InstallOptions {
        InstallOptions {
            cni_bin_dir: self.0.join("bin"),
            cni_conf_dir: self.0.join("net.d"),
            conf_file: None,
            plugin_binary: self.0.join("capture-cni-build"),
            agent_socket: SOCKET.into(),
            state_dir: None,
            replace_istio_cni,
        }
    }

    fn config(&self) -> String {
        fs::read_to_string(self.0.join("net.d/10-calico.conflist")).unwrap()
    }

    fn types(&self) -> Vec<String> {
        json(&self.config())["plugins"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p["type"].as_str().unwrap().to_string())
            .collect()
    }
}

impl Drop for ConfDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

#[test]
fn install_refuses_to_chain_beside_istio_cni_and_changes_nothing() {
    let dir = ConfDir::new("beside-istio-cni", WITH_ISTIO_CNI);
    let e = install(&dir.opts(false)).unwrap_err();
    let text = e.to_string();
    assert!(
        text.contains("10-calico.conflist")
            && text.contains("istio-cni")
            && text.contains("--replace-istio-cni"),
        "{text}"
    );
    assert_eq!(dir.config(), WITH_ISTIO_CNI);
    assert!(!istio::saved_path(&dir.0.join("net.d")).exists());
    assert!(
        !plugin_installed(&dir.0.join("bin")),
        "nothing is written when install-cni refuses"
    );
}

#[test]
fn replacing_istio_cni_keeps_its_entry_and_uninstall_puts_it_back_where_it_was() {
    let dir = ConfDir::new("replace-istio-cni", WITH_ISTIO_CNI);
    let conf = dir.0.join("net.d");
    let done = install(&dir.opts(true)).unwrap();
    assert!(done.config_changed && done.replaced_istio_cni);
    assert!(!install(&dir.opts(true)).unwrap().replaced_istio_cni);
    assert_eq!(dir.types(), ["calico", "portmap", "bandwidth", PLUGIN_TYPE]);
    let kept = istio::load(&conf).unwrap().expect("the entry is kept");
    assert_eq!(
        (kept.config.as_str(), kept.index, &kept.entry),
        ("10-calico.conflist", 3, &json(WITH_ISTIO_CNI)["plugins"][3])
    );
    // Runtimes read .conf, .conflist and .json only: the kept entry is not a configuration.
    assert_eq!(
        active_config(&conf).unwrap(),
        conf.join("10-calico.conflist")
    );
    assert!(!is_config_name(istio::SAVED_FILE));

    // Istio's DaemonSet writes its entry back: the node chose capture, so chaining again
    // (the agent's watcher, no flag) replaces it again.
    let mut rewritten = json(&dir.config());
    rewritten["plugins"]
        .as_array_mut()
        .unwrap()
        .push(json(r#"{"type": "istio-cni"}"#));
    fs::write(
        conf.join("10-calico.conflist"),
        serde_json::to_string_pretty(&rewritten).unwrap(),
    )
    .unwrap();
    let chained = chain(&dir.opts(false)).unwrap();
    assert!(chained.changed && chained.replaced_istio_cni);
    assert_eq!(dir.types(), ["calico", "portmap", "bandwidth", PLUGIN_TYPE]);
    let kept = istio::load(&conf).unwrap().unwrap();
    assert_eq!(
        kept.entry,
        json(r#"{"type": "istio-cni"}"#),
        "the newest is kept"
    );
    // Back to the original entry, as Istio wrote it, for the restore below.
    istio::save(
        &conf,
        &istio::Replaced {
            entry: json(WITH_ISTIO_CNI)["plugins"][3].clone(),
            ..kept
        },
    )
    .unwrap();

    assert_eq!(
        uninstall(&dir.opts(false)).unwrap(),
        vec![conf.join("10-calico.conflist")]
    );
    assert_eq!(json(&dir.config()), json(WITH_ISTIO_CNI));
    assert!(!istio::saved_path(&conf).exists());
    assert!(uninstall(&dir.opts(false)).unwrap().is_empty());
    // With istio-cni back, capture refuses again.
    assert!(matches!(
        install(&dir.opts(false)),
        Err(InstallError::IstioCniChained { .. })
    ));
}

#[test]
fn a_kept_entry_that_does_not_parse_is_named_and_nothing_is_lost() {
    let dir = ConfDir::new(
        "kept-unreadable",
        include_str!("testdata/10-calico.conflist"),
    );
    let conf = dir.0.join("net.d");
    fs::write(istio::saved_path(&conf), "{ half").unwrap();
    let e = install(&dir.opts(false)).unwrap_err().to_string();
    assert!(
        e.contains(istio::SAVED_FILE) && e.contains("by hand"),
        "{e}"
    );
    assert_eq!(
        fs::read_to_string(istio::saved_path(&conf)).unwrap(),
        "{ half"
    );
}

#[test]
fn an_istio_cni_that_serves_ambient_pods_is_never_replaced() {
    let ambient = WITH_ISTIO_CNI.replace("\"ambient_enabled\": false", "\"ambient_enabled\": true");
    let dir = ConfDir::new("ambient-istio-cni", &ambient);
    for replace in [false, true] {
        let e = install(&dir.opts(replace)).unwrap_err();
        assert!(
            matches!(e, InstallError::IstioCniServesAmbient { .. }),
            "replace {replace}: {e}"
        );
        let text = e.to_string();
        assert!(
            text.contains("10-calico.conflist") && text.contains("ambient"),
            "{text}"
        );
        assert_eq!(dir.config(), ambient, "nothing written");
        assert!(!istio::saved_path(&dir.0.join("net.d")).exists());
    }
    // A node that replaced a sidecar-only istio-cni, whose Istio DaemonSet then writes back an
    // entry with ambient on (ambient turned on in the mesh): chaining again refuses rather than
    // take ambient's enrolment away from the node's pods.
    let dir = ConfDir::new("ambient-later", WITH_ISTIO_CNI);
    install(&dir.opts(true)).unwrap();
    let mut rewritten = json(&dir.config());
    rewritten["plugins"]
        .as_array_mut()
        .unwrap()
        .push(json(r#"{"type": "istio-cni", "ambient_enabled": true}"#));
    let text = serde_json::to_string_pretty(&rewritten).unwrap();
    fs::write(dir.0.join("net.d/10-calico.conflist"), &text).unwrap();
    assert!(matches!(
        chain(&dir.opts(false)),
        Err(InstallError::IstioCniServesAmbient { .. })
    ));
    assert_eq!(dir.config(), text);
}
