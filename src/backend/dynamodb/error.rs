//! Maps AWS SDK errors into the crate's error kinds by DynamoDB error code, keeping the SDK error
//! (with its full context) as the source. The SDK owns retries (see
//! [`super::config::sdk_retry_config`]), so every error it returns has exhausted them and is
//! marked so: no outer loop retries it again.

use aws_sdk_dynamodb::error::{DisplayErrorContext, ProvideErrorMetadata, SdkError};

use crate::error::{Error, ErrorKind};

/// A failed write. A timeout, or a response that could not be read, came after the request was
/// sent: the write may have been applied (`OutcomeUnknown`), unlike a refusal or a connection
/// that could not be made.
pub(super) fn map_sdk_write<E, R>(err: SdkError<E, R>, doing: &str) -> Error
where
    E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
    R: std::fmt::Debug + Send + Sync + 'static,
{
    if matches!(err, SdkError::TimeoutError(_) | SdkError::ResponseError(_)) {
        let message = format!("DynamoDB did not answer while trying to {doing}; the write may have been applied");
        return Error::new(ErrorKind::OutcomeUnknown, message).with_source(err).with_retries_exhausted();
    }
    map_sdk(err, doing)
}

pub(super) fn map_sdk<E, R>(err: SdkError<E, R>, doing: &str) -> Error
where
    E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
    R: std::fmt::Debug + Send + Sync + 'static,
{
    let (kind, code) = match &err {
        SdkError::ServiceError(service) => {
            let code = service.err().code().unwrap_or("").to_owned();
            (kind_of_code(&code, service.err().message().unwrap_or("")), code)
        }
        SdkError::TimeoutError(_) | SdkError::DispatchFailure(_) | SdkError::ResponseError(_) => {
            (ErrorKind::Unavailable, String::new())
        }
        SdkError::ConstructionFailure(_) => (ErrorKind::Misconfigured, String::new()),
        _ => (ErrorKind::Internal, String::new()),
    };
    let detail = DisplayErrorContext(&err).to_string();
    let message = match kind {
        ErrorKind::Unauthorized => format!("DynamoDB refused our credentials while trying to {doing} ({code})"),
        ErrorKind::Unavailable if !code.is_empty() => {
            format!("DynamoDB is throttling or unavailable while trying to {doing} ({code})")
        }
        _ if code.is_empty() => format!("DynamoDB could not {doing}: {detail}"),
        _ => format!("DynamoDB could not {doing} ({code})"),
    };
    Error::new(kind, message).with_source(err).with_retries_exhausted()
}

fn kind_of_code(code: &str, message: &str) -> ErrorKind {
    match code {
        "ConditionalCheckFailedException" | "TransactionConflictException" => ErrorKind::Conflict,
        "ProvisionedThroughputExceededException"
        | "ThrottlingException"
        | "RequestLimitExceeded"
        | "LimitExceededException"
        | "InternalServerError"
        | "ServiceUnavailable"
        | "InternalFailure" => ErrorKind::Unavailable,
        "ResourceNotFoundException" => ErrorKind::Misconfigured,
        "AccessDeniedException"
        | "UnrecognizedClientException"
        | "InvalidSignatureException"
        | "ExpiredTokenException"
        | "MissingAuthenticationToken"
        | "IncompleteSignature" => ErrorKind::Unauthorized,
        "ValidationException" if message.contains("size") => ErrorKind::TooLarge,
        "ValidationException" | "SerializationException" => ErrorKind::InvalidInput,
        _ => ErrorKind::Internal,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_map_to_kinds() {
        assert_eq!(kind_of_code("ConditionalCheckFailedException", ""), ErrorKind::Conflict);
        assert_eq!(kind_of_code("ProvisionedThroughputExceededException", ""), ErrorKind::Unavailable);
        assert_eq!(kind_of_code("ThrottlingException", ""), ErrorKind::Unavailable);
        assert_eq!(kind_of_code("ResourceNotFoundException", ""), ErrorKind::Misconfigured);
        assert_eq!(kind_of_code("UnrecognizedClientException", ""), ErrorKind::Unauthorized);
        assert_eq!(
            kind_of_code("ValidationException", "Item size has exceeded the maximum allowed size"),
            ErrorKind::TooLarge
        );
        assert_eq!(kind_of_code("ValidationException", "bad"), ErrorKind::InvalidInput);
    }
}
