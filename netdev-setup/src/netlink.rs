//! A small blocking facade over `rtnetlink`: every link, address and veth change this crate
//! makes goes through here, never through `ip`. Each `Netlink` owns a current-thread tokio
//! runtime and a socket opened in the network namespace of the thread that created it, so a
//! thread that has entered a lab namespace talks to that namespace only.

use std::net::{IpAddr, Ipv4Addr};
use std::os::fd::{AsRawFd, BorrowedFd};

use futures::TryStreamExt;
use netlink_packet_route::address::AddressAttribute;
use netlink_packet_route::link::{
    InfoData, InfoKind, InfoVeth, LinkAttribute, LinkFlags, LinkMessage,
};
use netlink_packet_route::route::{RouteAddress, RouteAttribute};
use rtnetlink::{LinkMessageBuilder, LinkUnspec, RouteMessageBuilder};

use crate::error::{NetdevError, Result};
use crate::inventory::Link;

/// What netlink says about one interface.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LinkState {
    /// Interface index.
    pub index: u32,
    /// Interface name.
    pub name: String,
    /// Administratively up.
    pub up: bool,
    /// Current MTU.
    pub mtu: u32,
    /// The largest MTU the driver accepts, if it says.
    pub max_mtu: Option<u32>,
}

/// A netlink connection in the current thread's network namespace.
#[derive(Debug)]
pub struct Netlink {
    runtime: tokio::runtime::Runtime,
    handle: rtnetlink::Handle,
}

impl Netlink {
    /// Opens a route-netlink socket in the calling thread's network namespace.
    pub fn open() -> Result<Self> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| NetdevError::io("starting", "tokio runtime", e))?;
        let (connection, handle, _) = {
            let _guard = runtime.enter();
            rtnetlink::new_connection().map_err(|e| NetdevError::Netlink {
                operation: "open a route netlink socket".into(),
                message: e.to_string(),
            })?
        };
        runtime.spawn(connection);
        Ok(Self { runtime, handle })
    }

    /// Every interface in this namespace.
    pub fn links(&self) -> Result<Vec<LinkState>> {
        let messages: Vec<LinkMessage> = self
            .runtime
            .block_on(self.handle.link().get().execute().try_collect())
            .map_err(|e| netlink_error("list interfaces", e))?;
        Ok(messages.into_iter().map(link_state).collect())
    }

    /// One interface by name, or `None` when it does not exist here.
    pub fn link(&self, name: &str) -> Result<Option<LinkState>> {
        Ok(self.links()?.into_iter().find(|l| l.name == name))
    }

    /// IPv4 addresses on an interface.
    pub fn ipv4_addresses(&self, index: u32) -> Result<Vec<(Ipv4Addr, u8)>> {
        let messages: Vec<_> = self
            .runtime
            .block_on(
                self.handle
                    .address()
                    .get()
                    .set_link_index_filter(index)
                    .execute()
                    .try_collect(),
            )
            .map_err(|e| netlink_error("list addresses", e))?;
        let mut out = Vec::new();
        for message in messages {
            if message.header.index != index {
                continue;
            }
            let prefix = message.header.prefix_len;
            for attribute in message.attributes {
                if let AddressAttribute::Local(IpAddr::V4(a)) = attribute {
                    out.push((a, prefix));
                }
            }
        }
        out.sort();
        out.dedup();
        Ok(out)
    }

    /// Brings an interface up.
    pub fn set_up(&self, name: &str) -> Result<()> {
        let index = self.index_of(name)?;
        let message = LinkUnspec::new_with_index(index).up().build();
        self.runtime
            .block_on(self.handle.link().set(message).execute())
            .map_err(|e| netlink_error(&format!("bring {name} up"), e))
    }

    /// Sets an interface's MTU.
    pub fn set_mtu(&self, name: &str, mtu: u32) -> Result<()> {
        let index = self.index_of(name)?;
        let message = LinkUnspec::new_with_index(index).mtu(mtu).build();
        self.runtime
            .block_on(self.handle.link().set(message).execute())
            .map_err(|e| netlink_error(&format!("set MTU of {name} to {mtu}"), e))
    }

    /// Adds an IPv4 address.
    pub fn add_ipv4(&self, name: &str, address: Ipv4Addr, prefix_len: u8) -> Result<()> {
        let index = self.index_of(name)?;
        self.runtime
            .block_on(
                self.handle
                    .address()
                    .add(index, IpAddr::V4(address), prefix_len)
                    .execute(),
            )
            .map_err(|e| netlink_error(&format!("add {address}/{prefix_len} to {name}"), e))
    }

    /// Creates a veth pair whose two ends go straight into the given namespaces, so no end
    /// ever appears, even briefly, in the namespace this socket lives in.
    pub fn add_veth_between(
        &self,
        name: &str,
        name_ns: BorrowedFd<'_>,
        peer: &str,
        peer_ns: BorrowedFd<'_>,
        mtu: u32,
    ) -> Result<()> {
        let peer_message = LinkUnspec::new_with_name(peer)
            .mtu(mtu)
            .setns_by_fd(peer_ns.as_raw_fd())
            .build();
        let message = LinkMessageBuilder::<LinkUnspec>::new_with_info_kind(InfoKind::Veth)
            .name(name)
            .mtu(mtu)
            .setns_by_fd(name_ns.as_raw_fd())
            .set_info_data(InfoData::Veth(InfoVeth::Peer(peer_message)))
            .build();
        self.runtime
            .block_on(self.handle.link().add(message).execute())
            .map_err(|e| netlink_error(&format!("create veth {name} <-> {peer}"), e))
    }

    /// Adds (or replaces) the host route `destination/32 via gateway dev interface` in the
    /// main table.
    pub fn replace_host_route(
        &self,
        destination: Ipv4Addr,
        gateway: Ipv4Addr,
        interface: &str,
    ) -> Result<()> {
        let index = self.index_of(interface)?;
        let message = RouteMessageBuilder::<Ipv4Addr>::new()
            .destination_prefix(destination, 32)
            .gateway(gateway)
            .output_interface(index)
            .build();
        self.runtime
            .block_on(self.handle.route().add(message).replace().execute())
            .map_err(|e| {
                netlink_error(
                    &format!("add route {destination}/32 via {gateway} dev {interface}"),
                    e,
                )
            })
    }

    /// IPv4 host routes (/32 with a gateway) of the main table, as (destination, gateway).
    pub fn ipv4_host_routes(&self) -> Result<Vec<(Ipv4Addr, Ipv4Addr)>> {
        let query = RouteMessageBuilder::<Ipv4Addr>::new().build();
        let messages: Vec<_> = self
            .runtime
            .block_on(self.handle.route().get(query).execute().try_collect())
            .map_err(|e| netlink_error("list routes", e))?;
        let mut out = Vec::new();
        for message in messages {
            if message.header.destination_prefix_length != 32 {
                continue;
            }
            let (mut destination, mut gateway) = (None, None);
            for attribute in &message.attributes {
                match attribute {
                    RouteAttribute::Destination(RouteAddress::Inet(a)) => destination = Some(*a),
                    RouteAttribute::Gateway(RouteAddress::Inet(a)) => gateway = Some(*a),
                    _ => {}
                }
            }
            if let (Some(d), Some(g)) = (destination, gateway) {
                out.push((d, g));
            }
        }
        out.sort();
        out.dedup();
        Ok(out)
    }

    /// Deletes an interface (for a veth, both ends go).
    pub fn delete(&self, name: &str) -> Result<()> {
        let index = self.index_of(name)?;
        self.runtime
            .block_on(self.handle.link().del(index).execute())
            .map_err(|e| netlink_error(&format!("delete {name}"), e))
    }

    fn index_of(&self, name: &str) -> Result<u32> {
        self.link(name)?.map(|l| l.index).ok_or_else(|| {
            NetdevError::bad_input(
                format!("interface {name} does not exist"),
                "check the name with `tbrdma setup --dry-run`",
            )
        })
    }
}

/// Fills in what sysfs cannot tell: addresses, and the driver's maximum MTU for interfaces
/// whose target MTU is not known yet.
pub fn fill_live_state(links: &mut [Link]) -> Result<()> {
    if links.is_empty() {
        return Ok(());
    }
    let netlink = Netlink::open()?;
    let states = netlink.links()?;
    for link in links {
        if let Some(state) = states.iter().find(|s| s.name == link.interface) {
            link.addresses = netlink.ipv4_addresses(state.index)?;
            link.admin_up = state.up;
            link.mtu = state.mtu;
            if link.target_mtu.is_none() {
                link.target_mtu = state.max_mtu.filter(|&m| m > 0);
            }
        }
    }
    Ok(())
}

fn link_state(message: LinkMessage) -> LinkState {
    let mut state = LinkState {
        index: message.header.index,
        name: String::new(),
        up: message.header.flags.contains(LinkFlags::Up),
        mtu: 0,
        max_mtu: None,
    };
    for attribute in message.attributes {
        match attribute {
            LinkAttribute::IfName(name) => state.name = name,
            LinkAttribute::Mtu(mtu) => state.mtu = mtu,
            LinkAttribute::MaxMtu(mtu) => state.max_mtu = Some(mtu),
            _ => {}
        }
    }
    state
}

fn netlink_error(operation: &str, error: rtnetlink::Error) -> NetdevError {
    if let rtnetlink::Error::NetlinkError(message) = &error {
        if message.to_io().raw_os_error() == Some(nix::libc::EPERM) {
            return NetdevError::NeedsRoot {
                step: operation.to_owned(),
            };
        }
    }
    NetdevError::Netlink {
        operation: operation.to_owned(),
        message: error.to_string(),
    }
}
