// Validates ServiceMonitor objects (JSON array in the file argv[2]) against prometheus-operator's
// schema as @kubernetes-models/prometheus-operator ships it (generated from the operator's Go
// API types): field types, required fields, enums. MODELS: the package's directory.
// Prints one line per object; exits 1 when any fails.
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { pathToFileURL } from "node:url";

const models = process.env.MODELS;
const { ServiceMonitor } = await import(pathToFileURL(join(models, "monitoring.coreos.com/v1/ServiceMonitor.js")).href);
let failed = 0;
for (const object of JSON.parse(readFileSync(process.argv[2], "utf8"))) {
  const name = object?.metadata?.name;
  try {
    if (object.apiVersion !== "monitoring.coreos.com/v1" || object.kind !== "ServiceMonitor") {
      throw new Error(`not a monitoring.coreos.com/v1 ServiceMonitor: ${object.apiVersion} ${object.kind}`);
    }
    new ServiceMonitor(object).validate();
    console.log(`PASS servicemonitor/${name}`);
  } catch (error) {
    failed += 1;
    console.log(`FAIL servicemonitor/${name}: ${error.message}`);
  }
}
process.exit(failed ? 1 : 0);
