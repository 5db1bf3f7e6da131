//! Set-up shared by the verbs integration tests: caller-progress devices on this host's loopback
//! address, and a connected pair of them. (Each test binary uses the parts it needs.)
#![allow(dead_code)]

use std::time::Duration;

use tbrdma_verbs::*;

/// Caller progress, sockets engine, keeper checking every `keeper_period`.
pub fn caller_with_keeper(keeper_period: Duration) -> DeviceConfig {
    DeviceConfig {
        engine: EngineConfig {
            progress: Progress::Caller,
            engine: EngineKind::Sockets,
            keeper_period,
            ..Default::default()
        },
        port: 0,
    }
}

/// Caller progress, sockets engine, the default keeper.
pub fn caller() -> DeviceConfig {
    caller_with_keeper(EngineConfig::default().keeper_period)
}

/// A server device listening on loopback, with a region of `target_len` bytes its peers may
/// write.
pub struct Server {
    pub dev: Device,
    pub pd: ProtectionDomain,
    pub target: MemoryRegion,
    pub cq: CompletionQueue,
    pub listener: Listener,
}

pub fn server(config: DeviceConfig, target_len: usize, cq_capacity: usize) -> Server {
    let dev = Device::open("127.0.0.1", config).unwrap();
    let pd = dev.alloc_pd();
    let target = pd
        .alloc_mr(target_len, Access::LOCAL_WRITE | Access::REMOTE_WRITE)
        .unwrap();
    let cq = dev.create_cq(cq_capacity);
    let listener = Listener::bind(&dev, 0).unwrap();
    Server {
        dev,
        pd,
        target,
        cq,
        listener,
    }
}

/// A connected pair: the server's end writes land in `target`, the client sends from `src`
/// (`src_len` bytes, local access only). Each side has one completion queue for both queues.
pub struct Pair {
    pub server_dev: Device,
    pub server: Connected,
    pub server_cq: CompletionQueue,
    pub target: MemoryRegion,
    pub client_dev: Device,
    pub client: Connected,
    pub client_cq: CompletionQueue,
    pub src: MemoryRegion,
}

pub fn pair(config: DeviceConfig, target_len: usize, src_len: usize, cq_capacity: usize) -> Pair {
    let Server {
        dev: server_dev,
        pd: server_pd,
        target,
        cq: server_cq,
        listener,
    } = server(config.clone(), target_len, cq_capacity);
    let addr = listener.local_addr().unwrap();
    let accept = std::thread::spawn(move || {
        let c = listener
            .accept(
                &server_pd,
                &server_cq,
                &server_cq,
                &QpOptions::default(),
                Some(Duration::from_secs(10)),
            )
            .unwrap();
        (c, server_cq)
    });
    let client_dev = Device::open("127.0.0.1", config).unwrap();
    let client_pd = client_dev.alloc_pd();
    let client_cq = client_dev.create_cq(cq_capacity);
    let client = connect(
        &client_pd,
        addr,
        &client_cq,
        &client_cq,
        &QpOptions::default(),
    )
    .unwrap();
    let (server, server_cq) = accept.join().unwrap();
    let src = client_pd.alloc_mr(src_len, Access::LOCAL_WRITE).unwrap();
    Pair {
        server_dev,
        server,
        server_cq,
        target,
        client_dev,
        client,
        client_cq,
        src,
    }
}

/// Polls `cq` until a completion arrives (10 s at most) and checks that it succeeded.
pub fn next_completion(cq: &CompletionQueue) -> Completion {
    let mut buf = [Completion::default(); 1];
    let start = std::time::Instant::now();
    while start.elapsed() < Duration::from_secs(10) {
        if cq.poll(&mut buf).unwrap() == 1 {
            assert_eq!(buf[0].wc.status, WcStatus::Success, "{:?}", buf[0]);
            return buf[0];
        }
    }
    panic!("no completion within 10 s");
}
