//! The lockout of failed logins as several instances behind a load balancer see it: failures
//! made on two CouchDB faces over one backend add up to one count (each face locks the name at
//! CouchDB's threshold, 5), and behind a trusted proxy (`couchdb_trusted_proxies`) each client of
//! `X-Forwarded-For` is counted apart, while from any other peer the header is ignored.
//!
//! CouchDB 3.4.3's answer to a locked-out pair (checked against the real server, threshold 5):
//! 403 `{"error":"forbidden","reason":"Account is temporarily locked due to multiple
//! authentication failures"}`, also for the right password; the wrong passwords before it are
//! fixture 008's 401.

use super::logins::{logins_config, PASSWORD};
use super::*;

/// CouchDB's reason for a locked-out name and peer.
const LOCKED_OUT: &str = "Account is temporarily locked due to multiple authentication failures";
/// CouchDB's default `[chttpd_auth_lockout] threshold`, this server's `couchdb_lockout_threshold`.
const THRESHOLD: usize = 5;

/// The logins, with the test's own loopback address as the trusted balancer.
pub(super) fn trusted_loopback_config() -> Result<String, Failed> {
    // A top-level key: before the `[[couchdb_users]]` tables.
    Ok(format!("couchdb_trusted_proxies = [\"127.0.0.1\", \"::1\"]\n{}", logins_config()?))
}

/// A database read as `name` with `password`, from `client` (an `X-Forwarded-For`, if any).
async fn read_as(
    client: &reqwest::Client,
    root: &str,
    name: &str,
    password: &str,
    forwarded_for: Option<&str>,
) -> Result<Answer, Failed> {
    let mut request =
        client.get(format!("{root}/{DB}")).header("Accept", "application/json").basic_auth(name, Some(password));
    if let Some(forwarded_for) = forwarded_for {
        request = request.header("X-Forwarded-For", forwarded_for);
    }
    Answer::read(request.send().await?).await
}

/// The answer is CouchDB's 403 for a locked-out pair.
fn locked(answer: &Answer, what: &str) -> TestResult {
    check(answer.status == StatusCode::FORBIDDEN && answer.body["reason"] == json!(LOCKED_OUT), || {
        format!("{what}: {} {} where CouchDB answers 403 {LOCKED_OUT:?}", answer.status, answer.body)
    })
}

/// Wrong passwords for alice alternate between A and B (no balancer stickiness): at the threshold
/// both instances answer 403, the right password included; another name is not locked.
pub(super) async fn lockout_counted_across_instances(a: Endpoint) -> TestResult {
    let b = a.beside_configured().await?;
    let faces = [(&a.client, a.root.as_str()), (&b.client, b.root.as_str())];
    for attempt in 0..THRESHOLD {
        let (client, root) = faces[attempt % 2];
        let answer = read_as(client, root, "alice", "guess", None).await?;
        same_error(&answer, "008-auth-wrong-password").map_err(|e| format!("attempt {attempt}: {e:?}"))?;
    }
    locked(&read_as(&b.client, &b.root, "alice", PASSWORD, None).await?, "alice's right password on B")?;
    locked(&read_as(&a.client, &a.root, "alice", PASSWORD, None).await?, "alice's right password on A")?;
    read_as(&b.client, &b.root, "bob", PASSWORD, None).await?.expect(200, "bob on B")?;
    // The counts are the server's own local documents: never listed, even to an admin.
    let listing = a.client.get(a.url(&format!("/{DB}/_local_docs"))).basic_auth("admin", Some(PASSWORD));
    let listed = Answer::read(listing.send().await?).await?;
    // pouchdb-server, CI's stand-in for CouchDB, has no `_local_docs` (501 through the backend).
    if !(a.backend == "couchdb" && listed.status == StatusCode::NOT_IMPLEMENTED) {
        let listed = listed.expect(200, "_local_docs")?;
        check(!listed.body.to_string().contains("lockout"), || format!("_local_docs lists {}", listed.body))?;
    }
    // An instance started now reads the same count before it runs any hash.
    let c = a.beside_configured().await?;
    locked(&read_as(&c.client, &c.root, "alice", PASSWORD, None).await?, "alice on a third instance")
}

/// Behind the trusted loopback, guesses forwarded for one client lock that client only; a client
/// cannot escape by writing addresses of its own in front. From an untrusted peer (an instance
/// trusting no proxy) the header is ignored: every guess counts against the peer itself.
pub(super) async fn lockout_behind_trusted_proxies(a: Endpoint) -> TestResult {
    let (guesser, user) = ("203.0.113.1", "203.0.113.2");
    for attempt in 0..THRESHOLD {
        let answer = read_as(&a.client, &a.root, "alice", "guess", Some(guesser)).await?;
        answer.expect(401, &format!("guess {attempt} forwarded for {guesser}"))?;
    }
    locked(&read_as(&a.client, &a.root, "alice", PASSWORD, Some(guesser)).await?, "the guesser")?;
    let spoofed = format!("198.51.100.7, {guesser}");
    locked(&read_as(&a.client, &a.root, "alice", PASSWORD, Some(&spoofed)).await?, "the guesser, spoofing")?;
    read_as(&a.client, &a.root, "alice", PASSWORD, Some(user)).await?.expect(200, "alice from another client")?;
    read_as(&a.client, &a.root, "alice", PASSWORD, None).await?.expect(200, "alice from the balancer itself")?;

    let untrusting = untrusting_instance(&a).await?;
    for attempt in 0..THRESHOLD {
        let forwarded = format!("198.51.100.{attempt}");
        let answer = read_as(&untrusting.client, &untrusting.root, "bob", "guess", Some(&forwarded)).await?;
        answer.expect(401, &format!("guess {attempt} claiming {forwarded}"))?;
    }
    let answer = read_as(&untrusting.client, &untrusting.root, "bob", PASSWORD, Some("198.51.100.99")).await?;
    locked(&answer, "bob from an untrusted peer, claiming a fresh address")
}

/// An instance over `a`'s backend with the same logins and no trusted proxy.
async fn untrusting_instance(a: &Endpoint) -> Result<Beside, Failed> {
    let config_dir = tempfile::tempdir()?;
    let config_file = config_dir.path().join("agentstore.toml");
    let views = config_dir.path().join("views").display().to_string();
    std::fs::write(&config_file, format!("couchdb_view_index_dir = {views:?}\n{}", logins_config()?))?;
    let settings =
        Settings::load(Some(&config_file), &Overrides::default()).map_err(|e| Failed::from(e.to_string()))?;
    a.serve_beside(settings, Some(config_dir)).await
}
