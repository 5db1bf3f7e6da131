//! Prints what the kernel offers the engine, and how long finding out took.
//!
//! `cargo run -p tbrdma-engine --example probe`

fn main() {
    let start = std::time::Instant::now();
    let features = tbrdma_engine::probe::probe();
    let took = start.elapsed();
    print!("{features}");
    println!("probe took {:.2} ms", took.as_secs_f64() * 1e3);
}
