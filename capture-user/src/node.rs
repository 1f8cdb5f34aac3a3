//! What the binary decides once for the node, from its flags, and hands the operations that load
//! programs or write rules, as a value rather than a process-wide static: how many pods the
//! ebpf maps are sized for (`--max-pods`) and which iptables variant writes rules
//! (`--iptables-variant`).

use crate::{
    ebpf::sizing::{NodeSizing, SizingError},
    iptables::flavour::NodeVariant,
};

#[derive(Debug, Default)]
pub struct NodeChoices {
    pub sizing: NodeSizing,
    pub iptables: NodeVariant,
}

impl NodeChoices {
    /// From the flags: `max_pods` unset is the default sizing, `iptables` unset is detected.
    ///
    /// # Errors
    /// A `--max-pods` out of range.
    pub fn new(max_pods: Option<u32>, iptables: Option<String>) -> Result<Self, SizingError> {
        Ok(Self {
            sizing: max_pods.map_or(Ok(NodeSizing::default()), NodeSizing::new)?,
            iptables: NodeVariant::new(iptables),
        })
    }
}
