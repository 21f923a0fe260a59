//! The round-trip value corpus through the facade, shared by the backend groups.

use agentstore::store::DataStore;
use agentstore::ErrorKind;

use crate::common::json::{first_difference, survives_f64};

/// Writes every corpus value with `set` and reads it back with `get`; what came back changed
/// (compared by exact decimal value), as `name: what differs` lines. `exact`: whether the server
/// keeps numbers beyond double precision; when it does not, those values must be refused as
/// invalid input (never stored altered), and they are left out of the comparison.
pub async fn differences(store: &DataStore, exact: bool) -> Result<Vec<String>, String> {
    let mut failures = Vec::new();
    for case in &crate::common::corpus::cases() {
        let written = store.set("corpus", "values", &case.name, case.value.clone(), None, Some("container-test")).await;
        if !exact && !survives_f64(&case.value) {
            match written {
                Err(e) if e.kind() == ErrorKind::InvalidInput => {}
                Err(e) => failures.push(format!("{}: refused, but as {:?}: {e}", case.name, e.kind())),
                Ok(_) => failures.push(format!("{}: accepted by a server that stores JS doubles", case.name)),
            }
            continue;
        }
        let written = written.map_err(|e| format!("set {}: {e}", case.name))?;
        if let Some(diff) = first_difference(&case.value, &written.body["value"]) {
            failures.push(format!("{}: set returned {diff}", case.name));
        }
        let read = store
            .get("corpus", "values", &case.name, None)
            .await
            .map_err(|e| format!("get {}: {e}", case.name))?
            .ok_or_else(|| format!("get {}: not found after set", case.name))?;
        if let Some(diff) = first_difference(&case.value, &read.body["value"]) {
            failures.push(format!("{}: read back {diff}", case.name));
        }
    }
    Ok(failures)
}
