//! More containers in a running pod, as a pod spec with several gets them: any image, user,
//! groups and command, started by runc inside the sandbox like the app and the proxy.

use tonic::Status;

use super::{config::container_config_as, Containerd, CriPod};

/// A container the test adds to a pod.
#[derive(Clone, Debug)]
pub struct Extra<'a> {
    pub name: &'a str,
    pub image: &'a str,
    pub uid: i64,
    pub gid: i64,
    pub groups: &'a [i64],
    /// Replaces the image's entrypoint.
    pub command: Option<Vec<String>>,
    /// The container's restart count, as the kubelet names a restarted container.
    pub attempt: u32,
    /// Its environment, as the pod spec (and Istio's injector) gives it.
    pub env: &'a [(&'a str, &'a str)],
}

impl Containerd {
    /// Creates and starts `extra` in `pod` and records its id under its name. With `ready`, waits
    /// until its log says `ready` (a serving probe).
    pub fn add_container(
        &self,
        pod: &mut CriPod,
        extra: &Extra<'_>,
        ready: bool,
    ) -> Result<String, Status> {
        let ids = (extra.uid, extra.gid, extra.groups);
        let mut config = container_config_as(extra.name, extra.image, ids);
        config.metadata.as_mut().expect("metadata").attempt = extra.attempt;
        config.log_path = format!("{}-{}.log", extra.name, extra.attempt);
        config.command = extra.command.clone().unwrap_or_default();
        config.envs = extra
            .env
            .iter()
            .map(|(key, value)| k8s_cri::v1::KeyValue {
                key: (*key).to_string(),
                value: (*value).to_string(),
            })
            .collect();
        let id = self.cri().start_container(&pod.id, &config, &pod.config)?;
        pod.containers.insert(extra.name.to_string(), id.clone());
        if ready {
            Self::wait_listening(pod, &format!("{}-{}", extra.name, extra.attempt));
        }
        Ok(id)
    }

    /// Stops and removes `name` of `pod`, as the kubelet before it restarts a container.
    pub fn remove_container(&self, pod: &mut CriPod, name: &str) -> Result<(), Status> {
        let id = pod.container(name).to_string();
        self.cri().remove_container(&id)?;
        pod.containers.remove(name);
        Ok(())
    }

    /// The lines container `log` (its log file's stem) wrote, without the CRI log prefix.
    #[must_use]
    pub fn container_log(pod: &CriPod, log: &str) -> Vec<String> {
        let path = std::path::Path::new(&pod.config.log_directory).join(format!("{log}.log"));
        std::fs::read_to_string(path)
            .unwrap_or_default()
            .lines()
            // `<time> stdout F <line>`
            .filter_map(|l| l.splitn(4, ' ').nth(3).map(str::to_string))
            .collect()
    }
}
