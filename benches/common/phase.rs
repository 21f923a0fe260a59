//! A timed phase of concurrent closed-loop HTTP clients (`views_bench`, `balanced_bench`): each
//! client on a keep-alive connection of its own repeats a call until the phase's time is up, and
//! every call's wall time is kept.

use std::future::Future;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

/// A client that keeps one connection alive, each request bounded by `timeout`: one per
/// simulated client.
pub fn keep_alive_client(timeout: Duration) -> Result<reqwest::Client, String> {
    reqwest::Client::builder()
        .no_proxy()
        .pool_max_idle_per_host(1)
        .tcp_nodelay(true)
        .timeout(timeout)
        .build()
        .map_err(|e| format!("HTTP client: {}", super::describe(&e)))
}

/// Every call's wall time in one phase, and how long the phase ran.
pub struct Latencies {
    pub elapsed: Duration,
    /// Sorted, shortest first.
    pub sorted: Vec<Duration>,
}

impl Latencies {
    /// One client per connection of `connections`, each calling `call(connection, round)` with
    /// rounds spread over the clients (client `i` takes `i`, `i + n`, …) until `duration` has
    /// passed. The clients are futures of the caller's task, not tasks: each mostly waits on its
    /// socket. The first failed call ends the phase with its error.
    pub async fn measure<'a, F, Fut>(
        connections: &'a [reqwest::Client],
        duration: Duration,
        call: F,
    ) -> Result<Self, String>
    where
        F: Fn(&'a reqwest::Client, u64) -> Fut,
        Fut: Future<Output = Result<(), String>>,
    {
        let clients = connections.len() as u64;
        let started = Instant::now();
        let call = &call;
        let outcomes = futures::future::join_all(connections.iter().enumerate().map(|(client, http)| async move {
            let mut latencies = Vec::new();
            let mut round = client as u64;
            while started.elapsed() < duration {
                let began = Instant::now();
                call(http, round).await?;
                latencies.push(began.elapsed());
                round += clients;
            }
            Ok::<_, String>(latencies)
        }))
        .await;
        let elapsed = started.elapsed();
        let mut sorted = Vec::new();
        for outcome in outcomes {
            sorted.extend(outcome?);
        }
        sorted.sort();
        Ok(Latencies { elapsed, sorted })
    }

    pub fn per_s(&self) -> f64 {
        self.sorted.len() as f64 / self.elapsed.as_secs_f64().max(f64::MIN_POSITIVE)
    }

    pub fn quantile_ms(&self, q: f64) -> f64 {
        let index = ((self.sorted.len() as f64 * q).ceil() as usize).saturating_sub(1);
        self.sorted.get(index).map_or(f64::NAN, |d| d.as_secs_f64() * 1e3)
    }

    /// Calls, rate, median, p99 and longest call, for a bench's JSON report.
    pub fn to_json(&self) -> Value {
        json!({
            "calls": self.sorted.len(),
            "elapsed_s": self.elapsed.as_secs_f64(),
            "per_s": self.per_s(),
            "median_ms": self.quantile_ms(0.5),
            "p99_ms": self.quantile_ms(0.99),
            "max_ms": self.sorted.last().map(|d| d.as_secs_f64() * 1e3),
        })
    }
}
