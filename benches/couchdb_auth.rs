//! What authentication costs a CouchDB API request: one Argon2id verification (the default
//! parameters `agentstore hash-password` writes), a Basic request whose credentials are already
//! in the verified-credentials cache, and an `AuthSession` cookie; the cached paths alone and
//! from 16 concurrent tasks on a 2-worker runtime (the shape of the GET benchmark's load).
//!
//! `cargo bench --bench benches -- couchdb_auth` (no servers needed). Prints a table; numbers are in
//! docs/couchdb-api.md.

use std::sync::Arc;
use std::time::{Duration, Instant};

use agentstore::config::{Overrides, Settings};
use agentstore::couchdb_api::auth::{hash_password, CouchAuth};
use agentstore::couchdb_api::session::post_session;
use axum::http::{header, HeaderMap, HeaderValue};
use base64::Engine;

const PASSWORD: &str = "correct horse battery staple";
/// Wrong-password attempts timed: each runs the KDF.
const KDF_RUNS: u32 = 20;
/// Cached authentications timed per path.
const CACHED_RUNS: u32 = 200_000;
/// Concurrent tasks in the contended run, as the GET benchmark's 16 connections.
const TASKS: u32 = 16;

pub fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    runtime.block_on(run());
}

async fn run() {
    let auth = Arc::new(auth_with_one_login());
    let basic_ok = basic("alice", PASSWORD);
    let basic_wrong = basic("alice", "wrong");
    let cookie = log_in(&auth).await;

    // The login verified the password once and left it in the cache.
    assert_eq!(auth.password_verifications(), 1);
    let kdf = time(KDF_RUNS, || async { assert!(auth.authenticate(&basic_wrong).await.is_err()) }).await;
    assert_eq!(auth.password_verifications(), u64::from(KDF_RUNS) + 1, "every wrong password ran the KDF");
    let cached = time(CACHED_RUNS, || async { assert!(auth.authenticate(&basic_ok).await.unwrap().is_some()) }).await;
    let by_cookie = time(CACHED_RUNS, || async { assert!(auth.authenticate(&cookie).await.unwrap().is_some()) }).await;
    let contended_basic = concurrent(&auth, &basic_ok).await;
    let contended_cookie = concurrent(&auth, &cookie).await;
    assert_eq!(auth.password_verifications(), u64::from(KDF_RUNS) + 1, "cached paths ran no KDF");

    println!("| path | per request | requests/s |");
    println!("|---|---:|---:|");
    row("Argon2id verification (wrong password, m=19456 KiB, t=2, p=1)", kdf);
    row("Basic, credentials cached", cached);
    row("AuthSession cookie (HMAC-SHA256)", by_cookie);
    row(&format!("Basic, cached, {TASKS} tasks on 2 workers"), contended_basic);
    row(&format!("AuthSession cookie, {TASKS} tasks on 2 workers"), contended_cookie);
}

fn auth_with_one_login() -> CouchAuth {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("agentstore.toml");
    let hash = hash_password(PASSWORD).expect("hash");
    let toml = format!("[[couchdb_users]]\nname = \"alice\"\npassword_hash = \"{hash}\"\nuser = \"user_123\"\n");
    std::fs::write(&path, toml).expect("write config");
    let settings = Settings::load(Some(&path), &Overrides::default()).expect("settings");
    CouchAuth::from_settings(&settings).expect("couchdb_users")
}

fn basic(name: &str, password: &str) -> HeaderMap {
    let encoded = base64::engine::general_purpose::STANDARD.encode(format!("{name}:{password}"));
    let mut headers = HeaderMap::new();
    headers.insert(header::AUTHORIZATION, HeaderValue::from_str(&format!("Basic {encoded}")).expect("header"));
    headers
}

/// Headers carrying the cookie a `POST /_session` sets.
async fn log_in(auth: &CouchAuth) -> HeaderMap {
    let mut form = HeaderMap::new();
    form.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    let body = format!(r#"{{"name":"alice","password":"{PASSWORD}"}}"#);
    let response = post_session(auth, &form, None, body.into()).await;
    let set_cookie = response.headers()[header::SET_COOKIE].to_str().expect("cookie").to_owned();
    let pair = set_cookie.split(';').next().expect("name=value").to_owned();
    let mut headers = HeaderMap::new();
    headers.insert(header::COOKIE, HeaderValue::from_str(&pair).expect("cookie header"));
    headers
}

async fn time<F, Fut>(runs: u32, mut call: F) -> Duration
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let start = Instant::now();
    for _ in 0..runs {
        call().await;
    }
    start.elapsed() / runs
}

/// Time per request when `TASKS` tasks authenticate `CACHED_RUNS` requests between them.
async fn concurrent(auth: &Arc<CouchAuth>, headers: &HeaderMap) -> Duration {
    let start = Instant::now();
    let tasks: Vec<_> = (0..TASKS)
        .map(|_| {
            let (auth, headers) = (auth.clone(), headers.clone());
            tokio::spawn(async move {
                for _ in 0..CACHED_RUNS / TASKS {
                    assert!(auth.authenticate(&headers).await.unwrap().is_some());
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.expect("task");
    }
    start.elapsed() / CACHED_RUNS
}

fn row(what: &str, per_request: Duration) {
    let per_second = 1.0 / per_request.as_secs_f64();
    println!("| {what} | {:.2} µs | {per_second:.0} |", per_request.as_secs_f64() * 1e6);
}
