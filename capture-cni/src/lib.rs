//! `capture-cni`: the chained CNI plugin. Every capture decision is the agent's; the plugin
//! finds the pod and asks. Kept to the model and system crates, so that the binary the runtime
//! execs on every pod ADD links no kernel loader, async runtime or rule backend.

pub mod plugin;
