//! What the CouchDB API counts of its own requests, for the node's statistics
//! (`/_node/{node}/_stats`, `/_node/{node}/_prometheus`: [`super::node`]): requests in all, by
//! method and by status (the methods and statuses CouchDB 3.4.3 counts, others only in the
//! total), and how long each took, kept for the last [`WINDOW`] as CouchDB keeps its histograms
//! (`[stats] interval`). The REST face's `/metrics` counts its own requests apart.
//!
//! The window holds at most [`MAX_SAMPLES`] durations: under more requests than that within
//! [`WINDOW`], the oldest go first, so the summary describes the latest ones. A summary is
//! computed from the durations themselves (CouchDB computes it from base-2 bins, so its values
//! are the bins' and ours the exact ones).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::Response;
use serde_json::{json, Value};

/// How far back request durations are summarised (CouchDB's `[stats] interval` default).
pub const WINDOW: Duration = Duration::from_secs(10);

/// Most request durations kept for the summary.
pub const MAX_SAMPLES: usize = 65_536;

/// The methods CouchDB 3.4.3 counts one by one (`httpd_request_methods`).
pub const METHODS: [&str; 7] = ["COPY", "DELETE", "GET", "HEAD", "OPTIONS", "POST", "PUT"];

/// The statuses CouchDB 3.4.3 counts one by one (`httpd_status_codes`).
pub const STATUSES: [u16; 25] = [
    200, 201, 202, 204, 206, 301, 302, 304, 400, 401, 403, 404, 405, 406, 409, 412, 413, 414, 415, 416, 417, 500, 501,
    503, 507,
];

/// The percentiles a summary gives, as CouchDB names them (`999` is the 99.9th).
const PERCENTILES: [(u32, f64); 6] = [(50, 0.5), (75, 0.75), (90, 0.9), (95, 0.95), (99, 0.99), (999, 0.999)];

/// The CouchDB API's request counts and durations since the process started.
pub struct RequestStats {
    started: Instant,
    requests: AtomicU64,
    methods: [AtomicU64; METHODS.len()],
    statuses: [AtomicU64; STATUSES.len()],
    /// When each recent request ended and how long it took, in milliseconds, oldest first.
    durations: Mutex<VecDeque<(Instant, f64)>>,
}

impl Default for RequestStats {
    fn default() -> Self {
        RequestStats {
            started: Instant::now(),
            requests: AtomicU64::new(0),
            methods: Default::default(),
            statuses: Default::default(),
            durations: Mutex::new(VecDeque::new()),
        }
    }
}

/// A summary of the durations within the window, in milliseconds.
#[derive(Debug, Clone, PartialEq)]
pub struct Summary {
    pub n: usize,
    pub min: f64,
    pub max: f64,
    pub sum: f64,
    pub arithmetic_mean: f64,
    pub geometric_mean: f64,
    pub harmonic_mean: f64,
    pub median: f64,
    pub variance: f64,
    pub standard_deviation: f64,
    pub skewness: f64,
    pub kurtosis: f64,
    /// `(name, value)` per percentile of [`PERCENTILES`].
    pub percentiles: Vec<(u32, f64)>,
}

impl RequestStats {
    /// Counts one answered request.
    pub fn record(&self, method: &str, status: u16, took: Duration) {
        self.requests.fetch_add(1, Ordering::Relaxed);
        if let Some(at) = METHODS.iter().position(|m| *m == method) {
            self.methods[at].fetch_add(1, Ordering::Relaxed);
        }
        if let Some(at) = STATUSES.iter().position(|s| *s == status) {
            self.statuses[at].fetch_add(1, Ordering::Relaxed);
        }
        let now = Instant::now();
        let mut durations = self.durations.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        prune(&mut durations, now);
        if durations.len() >= MAX_SAMPLES {
            durations.pop_front();
        }
        durations.push_back((now, took.as_secs_f64() * 1000.0));
    }

    pub fn requests(&self) -> u64 {
        self.requests.load(Ordering::Relaxed)
    }

    /// Each counted method with its count, in [`METHODS`] order.
    pub fn by_method(&self) -> impl Iterator<Item = (&'static str, u64)> + '_ {
        METHODS.iter().zip(&self.methods).map(|(m, c)| (*m, c.load(Ordering::Relaxed)))
    }

    /// Each counted status with its count, in [`STATUSES`] order.
    pub fn by_status(&self) -> impl Iterator<Item = (u16, u64)> + '_ {
        STATUSES.iter().zip(&self.statuses).map(|(s, c)| (*s, c.load(Ordering::Relaxed)))
    }

    /// Whole seconds since the process started counting.
    pub fn uptime_secs(&self) -> u64 {
        self.started.elapsed().as_secs()
    }

    /// The summary of the durations within the window.
    pub fn request_time(&self) -> Summary {
        let mut durations = self.durations.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        prune(&mut durations, Instant::now());
        let samples: Vec<f64> = durations.iter().map(|(_, ms)| *ms).collect();
        drop(durations);
        summarise(samples)
    }
}

/// Drops the durations older than the window.
fn prune(durations: &mut VecDeque<(Instant, f64)>, now: Instant) {
    while durations.front().is_some_and(|(at, _)| now.duration_since(*at) > WINDOW) {
        durations.pop_front();
    }
}

/// The summary of `samples` (CouchDB's fields; all zero when there are none, as CouchDB answers
/// an empty histogram). Moments are the population's (divided by n), as CouchDB's are.
pub fn summarise(mut samples: Vec<f64>) -> Summary {
    samples.sort_by(f64::total_cmp);
    let n = samples.len();
    if n == 0 {
        return Summary {
            n: 0,
            min: 0.0,
            max: 0.0,
            sum: 0.0,
            arithmetic_mean: 0.0,
            geometric_mean: 0.0,
            harmonic_mean: 0.0,
            median: 0.0,
            variance: 0.0,
            standard_deviation: 0.0,
            skewness: 0.0,
            kurtosis: 0.0,
            percentiles: PERCENTILES.iter().map(|(name, _)| (*name, 0.0)).collect(),
        };
    }
    let count = n as f64;
    let sum: f64 = samples.iter().sum();
    let mean = sum / count;
    // A zero duration has no logarithm or inverse: the smallest positive double stands in.
    let positive = |x: f64| x.max(f64::MIN_POSITIVE);
    let geometric_mean = (samples.iter().map(|x| positive(*x).ln()).sum::<f64>() / count).exp();
    let harmonic_mean = count / samples.iter().map(|x| 1.0 / positive(*x)).sum::<f64>();
    let moment = |power: i32| samples.iter().map(|x| (x - mean).powi(power)).sum::<f64>() / count;
    let variance = moment(2);
    let standard_deviation = variance.sqrt();
    // Too little spread to divide by: CouchDB answers 0 there too.
    let (skewness, kurtosis) = if standard_deviation.powi(3) < 1e-12 {
        (0.0, 0.0)
    } else {
        (moment(3) / standard_deviation.powi(3), moment(4) / standard_deviation.powi(4) - 3.0)
    };
    let at = |q: f64| samples[((q * count).ceil() as usize).clamp(1, n) - 1];
    Summary {
        n,
        min: samples[0],
        max: samples[n - 1],
        sum,
        arithmetic_mean: mean,
        geometric_mean,
        harmonic_mean,
        median: at(0.5),
        variance,
        standard_deviation,
        skewness,
        kurtosis,
        percentiles: PERCENTILES.iter().map(|(name, q)| (*name, at(*q))).collect(),
    }
}

impl Summary {
    /// The summary as the value of a CouchDB histogram statistic.
    pub fn to_json(&self) -> Value {
        let percentiles: Vec<Value> = self.percentiles.iter().map(|(name, value)| json!([name, value])).collect();
        json!({
            "n": self.n,
            "min": self.min,
            "max": self.max,
            "arithmetic_mean": self.arithmetic_mean,
            "geometric_mean": self.geometric_mean,
            "harmonic_mean": self.harmonic_mean,
            "median": self.median,
            "variance": self.variance,
            "standard_deviation": self.standard_deviation,
            "skewness": self.skewness,
            "kurtosis": self.kurtosis,
            "percentile": percentiles,
            // CouchDB 3.4.3 answers this placeholder for compatibility; so does this server.
            "histogram": [[0, 0]],
        })
    }
}

/// Middleware: counts every request of the CouchDB API and how long it took until its response
/// began (CouchDB's `request_time` likewise ends when its handler returns).
pub async fn count_requests(State(stats): State<Arc<RequestStats>>, request: Request, next: Next) -> Response {
    let started = Instant::now();
    let method = request.method().as_str().to_owned();
    let response = next.run(request).await;
    stats.record(&method, response.status().as_u16(), started.elapsed());
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_by_method_and_status_and_the_total() {
        let stats = RequestStats::default();
        stats.record("GET", 200, Duration::from_millis(2));
        stats.record("GET", 404, Duration::from_millis(4));
        stats.record("PROPFIND", 418, Duration::from_millis(6));
        assert_eq!(stats.requests(), 3);
        let get = stats.by_method().find(|(m, _)| *m == "GET").map(|(_, c)| c);
        assert_eq!(get, Some(2));
        let counted: u64 = stats.by_status().map(|(_, c)| c).sum();
        assert_eq!(counted, 2, "418 is not among CouchDB's counted statuses");
        let time = stats.request_time();
        assert_eq!((time.n, time.min, time.max), (3, 2.0, 6.0));
        assert!((time.arithmetic_mean - 4.0).abs() < 1e-9);
    }

    #[test]
    fn summary_of_known_samples() {
        let summary = summarise(vec![4.0, 1.0, 2.0, 1.0]);
        assert_eq!((summary.n, summary.min, summary.max, summary.sum), (4, 1.0, 4.0, 8.0));
        assert!((summary.arithmetic_mean - 2.0).abs() < 1e-12);
        assert!((summary.geometric_mean - 8f64.powf(0.25)).abs() < 1e-12);
        assert!((summary.harmonic_mean - 4.0 / 2.75).abs() < 1e-12);
        // Population variance: ((1+1+0+4) / 4).
        assert!((summary.variance - 1.5).abs() < 1e-12);
        assert_eq!(summary.median, 1.0);
        assert_eq!(summary.percentiles.last(), Some(&(999, 4.0)));
        let empty = summarise(Vec::new());
        assert_eq!((empty.n, empty.max, empty.percentiles.len()), (0, 0.0, 6));
    }

    #[test]
    fn the_window_keeps_the_latest_samples_only() {
        let stats = RequestStats::default();
        for _ in 0..MAX_SAMPLES + 10 {
            stats.record("GET", 200, Duration::from_millis(1));
        }
        assert_eq!(stats.request_time().n, MAX_SAMPLES);
        assert_eq!(stats.requests(), (MAX_SAMPLES + 10) as u64);
    }
}
